"""DSpark over omlx's own DeepSeek-V4 at TP4 on the ring (the stages split four ways with the backbone's own
split, each rank given its heads' sinks), drafts often accepted: greedy and seeded answers of 160 tokens, plain
decoding's token for token and logprob for logprob."""

from pinned.dsv4 import answers, build_v4_checkpoint, check_drafted

TOKENS = 160  # a 16-token window rotates ten times, a ratio-128 pool completes in any 128 of them


def test_drafted_answers_at_tp4_are_plain_decodings_token_for_token(tmp_path):
    model = build_v4_checkpoint(tmp_path / "v4")
    plain, _, _ = answers(model, 1, tmp_path / "plain", TOKENS, "--drafter", "off")
    check_drafted(*answers(model, 4, tmp_path / "tp4", TOKENS), plain, True, TOKENS)
