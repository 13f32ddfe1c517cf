"""The checkpoint checked before any rank loads it (common/checkpoint.py), on tiny checkpoints in DeepSeek-V4's
published layout (checkpoint tensor names, MXFP4 experts, MXFP8 attention, DSpark stages under mtp.*): as
tables of dtypes and shapes, and on disk as safetensors headers with no tensor data behind them, so a check
that loaded a tensor could not pass. Each fault is named with its config key and fix: overrides keyed by
checkpoint tensor name, stripped MTP, a V3-shaped config over DSpark stages, stage counts, shapes against the
config. Then where it is said: doctor's judgement, model pull's lines and its check of a repo before the
download, the rank's drafter line, and a real agent that reports a finding and refuses a start on it."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from common import checkpoint as ck
from kit.agents import make_agents, ring_hostfile
from kit.configs import write_mesh
from kit.meshctl import meshctl
from meshd.meshctl.ports import free_ports, free_run
from meshd.meshctl import modelpull
from meshd.nodes import doctor
from runtime.models.overlay import OMLX, drafter_off

HIDDEN, VOCAB, LAYERS, EXPERTS, Q_LORA = 64, 128, 3, 4, 32
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}


def packed(name: str, out: int, inputs: int, bits: int) -> dict:
    """A module packed MLX's way at `bits` in groups of 32: uint32 lanes and uint8 (e8m0) scales."""
    return {f"{name}.weight": ("U32", (out, inputs * bits // 32)), f"{name}.scales": ("U8", (out, inputs // 32))}


def v4(stages: int = 3, experts: int = EXPERTS, v3_head: bool = False) -> dict:
    """DeepSeek-V4's tensors by checkpoint name: MXFP8 attention and shared experts, MXFP4 routed experts
    stored one by one, and `stages` DSpark stages (a V3-shaped MTP head instead with `v3_head`)."""
    t = {"embed.weight": ("BF16", (VOCAB, HIDDEN)), "head.weight": ("BF16", (VOCAB, HIDDEN)),
         "norm.weight": ("BF16", (HIDDEN,))}
    blocks = [f"layers.{i}" for i in range(LAYERS)] + [f"mtp.{s}" for s in range(stages)]
    for b in blocks:
        t |= packed(f"{b}.attn.wq_a", Q_LORA, HIDDEN, 8) | packed(f"{b}.ffn.shared_experts.w1", 32, HIDDEN, 8)
        for e in range(experts):
            t |= packed(f"{b}.ffn.experts.{e}.w1", 32, HIDDEN, 4)
    if stages and v3_head:
        t |= packed("mtp.0.e_proj", HIDDEN, HIDDEN, 8) | packed("mtp.0.h_proj", HIDDEN, HIDDEN, 8)
    elif stages:
        t |= packed("mtp.0.main_proj", HIDDEN, HIDDEN * LAYERS, 8)
        t[f"mtp.{stages - 1}.markov_head.markov_w1.weight"] = ("BF16", (VOCAB, 8))
    return {k: ck.Tensor(d, s) for k, (d, s) in t.items()}


def mxfp8_modules(spelling, stages: int = 3) -> dict:
    """The overrides of v4(stages)'s MXFP8 modules, each key spelled by `spelling`."""
    blocks = [f"layers.{i}" for i in range(LAYERS)] + [f"mtp.{s}" for s in range(stages)]
    return {spelling(f"{b}.{m}"): MXFP8 for b in blocks for m in ("attn.wq_a", "ffn.shared_experts.w1")
            } | ({spelling("mtp.0.main_proj"): MXFP8} if stages else {})


def module_path(name: str) -> str:
    return ("model." + name if name.startswith("layers.") else name).replace("shared_experts.w1",
                                                                             "shared_experts.gate_proj")


def config(**changes) -> dict:
    base = {"model_type": "deepseek_v4", "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "n_routed_experts": EXPERTS, "num_nextn_predict_layers": 1, "n_mtp_layers": 3, "dspark_block_size": 5,
            "dspark_target_layer_ids": [0, 1, 2], "quantization": {**MXFP4, **mxfp8_modules(module_path)}}
    return {k: v for k, v in {**base, **changes}.items() if v is not None}


def fatal(report: ck.Report) -> dict[str, str]:
    return {f.key: f.line() for f in report.findings if f.fatal}


def test_a_sound_dspark_checkpoint_has_no_finding_and_says_it_drafts():
    report = ck.check(config(), v4())
    assert report.findings == () and report.refusal() is None
    assert report.drafting.dspark and report.drafting.why.startswith(
        "DSpark-capable: 3 stages (mtp.0-2), stage 0's main_proj over layers [0, 1, 2], blocks of 5")
    # the published config's num_nextn_predict_layers: 1 is said once, as what it hides from V3-shaped loaders
    assert "num_nextn_predict_layers 1 is the V3 field" in report.drafting.why


def test_overrides_keyed_by_checkpoint_tensor_name_fall_back_to_the_default_and_fail_named():
    miskeyed = config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)})
    report = ck.check(miskeyed, v4())
    [finding] = report.findings
    assert finding.fatal and finding.key == "quantization.layers.0.attn.wq_a"
    # the layers' wq_a and shared experts, and the stages' shared experts (w1 is gate_proj as a module)
    assert "9 overrides in config.json's quantization are keyed by checkpoint tensor name" in finding.problem
    assert "layers.0.attn.wq_a → model.layers.0.attn.wq_a" in finding.problem
    assert ("9 modules packed mxfp8 (8-bit, group 32) fall back to the default mxfp4 (4-bit, group 32) and the load "
            "fails with \"Expected shape (32, 8) but received shape (32, 16) for parameter "
            "model.layers.0.attn.wq_a.weight\"") in finding.problem
    assert '"model.layers.0.attn.wq_a"' in finding.fix and "both spellings" in finding.fix
    assert "quantization.layers.0.attn.wq_a" in report.refusal()


def test_the_published_checkpoints_own_numbers():
    """The seeds' load error, from one attention module: 4096 inputs at 8 bits are 1024 lanes, at 4 bits 512."""
    t = {k: ck.Tensor(d, s) for k, (d, s) in packed("layers.0.attn.wq_a", 1024, 4096, 8).items()}
    report = ck.check({"model_type": "deepseek_v4", "quantization": {**MXFP4, "layers.0.attn.wq_a": MXFP8}}, t)
    assert ('the load fails with "Expected shape (1024, 512) but received shape (1024, 1024) for parameter '
            'model.layers.0.attn.wq_a.weight"') in report.refusal()


def test_both_spellings_resolve_and_an_inferring_loader_is_only_told():
    both = config(quantization={**MXFP4, **mxfp8_modules(lambda n: n), **mxfp8_modules(module_path)})
    assert ck.check(both, v4()).findings == ()
    miskeyed = config(model_type="deepseek_v41", quantization={**MXFP4, **mxfp8_modules(module_path)})
    assert ck.check(miskeyed, v4(), takes_default=False).findings == ()  # already module paths: nothing to rename
    told = ck.check(config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)}), v4(), takes_default=False)
    assert [f.fatal for f in told.findings] == [False] and "loads here" in told.findings[0].problem


def test_modules_no_override_names_and_overrides_naming_nothing():
    unnamed = ck.check(config(quantization=MXFP4), v4())
    [finding] = unnamed.findings
    assert finding.fatal and finding.key == "quantization.model.layers.0.attn.wq_a"
    assert finding.problem.startswith("13 modules are packed otherwise than config.json's quantization gives them")
    assert '"model.layers.0.attn.wq_a": {"group_size": 32, "bits": 8, "mode": "mxfp8"}' in finding.fix
    stray = ck.check(config(quantization={**MXFP4, **mxfp8_modules(module_path), "model.layers.9.attn.wq_a": MXFP8}),
                     v4())
    assert [(f.key, f.fatal) for f in stray.findings] == [("quantization.model.layers.9.attn.wq_a", False)]
    assert "name no module of the checkpoint" in stray.findings[0].problem


@pytest.mark.parametrize("changes,stages,v3_head,why", [
    ({}, 0, False, "config.json declares DSpark (dspark_block_size 5, dspark_target_layer_ids [0, 1, 2]) but the "
                   "checkpoint holds no mtp.* tensors: the conversion stripped them, so DSpark is inert"),
    ({"n_mtp_layers": None, "dspark_block_size": None, "dspark_target_layer_ids": None}, 0, False,
     "the checkpoint holds no mtp.* tensors (community conversions strip them) and config.json declares no DSpark"),
    ({"n_mtp_layers": None, "dspark_block_size": None, "dspark_target_layer_ids": None}, 1, True,
     "the checkpoint holds a V3-shaped MTP head (e_proj/h_proj), not DSpark's stages"),
])
def test_a_checkpoint_that_will_serve_undrafted_says_so_once_with_why(changes, stages, v3_head, why):
    quantization = {**MXFP4, **mxfp8_modules(module_path, stages)}
    if v3_head:
        quantization = {k: v for k, v in quantization.items() if k != "mtp.0.main_proj"} | {
            "mtp.0.e_proj": MXFP8, "mtp.0.h_proj": MXFP8}
    report = ck.check(config(**changes, quantization=quantization), v4(stages, v3_head=v3_head))
    assert not report.drafting.dspark and report.drafting.why.startswith(why), report.drafting
    assert "mtp." in report.drafting.fix and report.findings == ()


def test_dspark_stages_under_a_v3_shaped_config_and_wrong_stage_counts_fail_named():
    v3_config = config(n_mtp_layers=None, dspark_block_size=None, dspark_target_layer_ids=None)
    assert set(fatal(ck.check(v3_config, v4()))) == {"dspark_block_size"}
    assert "num_nextn_predict_layers=1 V3-shaped heads" in fatal(ck.check(v3_config, v4()))["dspark_block_size"]
    two = fatal(ck.check(config(n_mtp_layers=2), v4()))
    assert set(two) == {"n_mtp_layers"} and "fix: set n_mtp_layers to 3" in two["n_mtp_layers"]
    narrow = fatal(ck.check(config(n_mtp_layers=3, dspark_target_layer_ids=[1, 2]), v4()))
    assert set(narrow) == {"dspark_target_layer_ids"} and "= 128 inputs, but mtp.0.main_proj is 192 wide" in narrow[
        "dspark_target_layer_ids"]
    heads = ck.check(config(n_mtp_layers=None, dspark_block_size=None, dspark_target_layer_ids=None,
                            num_nextn_predict_layers=2, quantization=MXFP4), v4(1, v3_head=True),
                     takes_default=False)
    assert set(fatal(heads)) == {"num_nextn_predict_layers"}


@pytest.mark.parametrize("changes,experts,key,words", [
    ({"vocab_size": 256}, EXPERTS, "vocab_size",
     "is 256 but the embedding (embed.weight) holds 128 rows and the output head (head.weight) holds 128 rows"),
    ({"hidden_size": 96}, EXPERTS, "hidden_size",
     "is 96 but the embedding (embed.weight) is 64 wide and the output head"),
    ({"num_hidden_layers": 5}, EXPERTS, "num_hidden_layers", "layers 3-4 are missing"),
    ({}, 2, "n_routed_experts", "is 4 but layers.0.ffn.experts, layers.1.ffn.experts, layers.2.ffn.experts and 3 "
                                "more hold 2 experts"),
])
def test_weight_shapes_against_the_config(changes, experts, key, words):
    found = fatal(ck.check(config(**changes), v4(experts=experts)))
    assert key in found and words in found[key], found


def test_another_family_in_mlx_format_is_judged_by_module_path_and_not_asked_about_mtp():
    t = {"model.embed_tokens.weight": ck.Tensor("U32", (VOCAB, HIDDEN // 8)),
         "model.embed_tokens.scales": ck.Tensor("BF16", (VOCAB, HIDDEN // 64)),
         "model.embed_tokens.biases": ck.Tensor("BF16", (VOCAB, HIDDEN // 64)),
         "model.layers.0.mlp.switch_mlp.gate_proj.weight": ck.Tensor("U32", (8, 32, HIDDEN // 8)),
         "model.layers.0.mlp.switch_mlp.gate_proj.scales": ck.Tensor("BF16", (8, 32, HIDDEN // 64))}
    qwen = {"model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 1,
            "num_experts": 8, "quantization": {"group_size": 64, "bits": 4}}
    report = ck.check(qwen, t)
    assert report.findings == () and report.drafting is None
    assert set(fatal(ck.check({**qwen, "num_experts": 16}, t))) == {"n_routed_experts"}


# --- on disk: headers only ---------------------------------------------------------------------------------

def write_checkpoint(root: Path, cfg: dict, tensors: dict[str, ck.Tensor], files: int = 2) -> Path:
    """config.json, an index and `files` .safetensors files that hold each tensor's header entry and no data."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        mine = names[i::files]
        head = json.dumps({"__metadata__": {"format": "mlx"}} | {
            n: {"dtype": tensors[n].dtype, "shape": list(tensors[n].shape), "data_offsets": [0, 0]} for n in mine})
        (root / name).write_bytes(len(head).to_bytes(8, "little") + head.encode())
        weight_map |= {n: name for n in mine}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def test_a_checkpoint_on_disk_is_judged_from_its_index_and_headers(tmp_path):
    good = ck.survey(write_checkpoint(tmp_path / "good", config(), v4()))
    assert good.findings == () and good.drafting.dspark and good.tensors == len(v4())
    bad = ck.survey(write_checkpoint(tmp_path / "bad", config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)}),
                                     v4()))
    assert set(fatal(bad)) == {"quantization.layers.0.attn.wq_a"}
    assert bad.to_dict()["findings"][0]["key"] == "quantization.layers.0.attn.wq_a"
    assert ck.tensors(tmp_path / "good")["layers.0.attn.wq_a.weight"] == ck.Tensor("U32", (Q_LORA, 16))


def test_a_cut_download_or_a_broken_header_is_a_fatal_finding_naming_the_file(tmp_path):
    cut = write_checkpoint(tmp_path / "cut", config(), v4())
    (cut / "model-00002-of-00002.safetensors").unlink()
    [finding] = ck.survey(cut).findings
    assert finding.fatal and "names model-00002-of-00002.safetensors, which is not in" in finding.problem
    broken = write_checkpoint(tmp_path / "broken", config(), v4(), files=1)
    (broken / "model-00001-of-00001.safetensors").write_bytes((1 << 40).to_bytes(8, "little"))
    [finding] = ck.survey(broken).findings
    assert finding.fatal and "is not a safetensors file (its header claims" in finding.problem
    assert ck.survey(tmp_path / "no-such-model") == ck.Report((), None, 0)


# --- where it is said: doctor, model pull, the agent -------------------------------------------------------

def facts_of(report: ck.Report) -> dict:
    return {"model": {"present": True, "checkpoint": report.to_dict()}}


def test_doctor_says_each_finding_once_and_fails_on_one_that_fails_the_load():
    miskeyed = ck.check(config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)}), v4())
    checks = doctor.judge_checkpoint({"node0": facts_of(miskeyed), "node1": facts_of(miskeyed)})
    assert [(c.node, c.ok, c.warn) for c in checks] == [("mesh", False, False), ("mesh", True, False)]
    assert checks[0].detail.startswith("quantization.layers.0.attn.wq_a: 9 overrides")
    assert "both spellings" in checks[0].fix
    assert checks[1].detail.startswith("DSpark-capable: 3 stages")
    stripped = ck.check(config(quantization={**MXFP4, **mxfp8_modules(module_path, 0)}), v4(0))
    checks = doctor.judge_checkpoint({"node0": facts_of(stripped), "node1": facts_of(ck.check(config(), v4())),
                                      "node2": {"model": {"present": False}}})
    assert [(c.node, c.ok, c.warn) for c in checks] == [("node0", True, True), ("node1", True, False)]
    assert checks[0].detail.startswith("serves undrafted: config.json declares DSpark") and "mtp." in checks[0].fix
    assert doctor.judge_checkpoint({"node0": {"model": {"present": True}}}) == []  # an agent that does not check


def test_model_pull_says_the_sources_findings_and_refuses_to_copy_one_that_will_not_load():
    report = ck.check(config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)}), v4())
    lines = modelpull.said(ck.Report.from_dict(report.to_dict()))
    assert lines[0].startswith("FAIL quantization.layers.0.attn.wq_a: 9 overrides")
    assert "\n     fix: key each" in lines[0]
    assert lines[1].startswith("DSpark-capable")
    assert modelpull.said(ck.check(config(quantization={**MXFP4, **mxfp8_modules(module_path, 0)}), v4(0))) == [
        "serves undrafted: config.json declares DSpark (dspark_block_size 5, dspark_target_layer_ids [0, 1, 2]) but "
        "the checkpoint holds no mtp.* tensors: the conversion stripped them, so DSpark is inert\n     fix: "
        + ck.KEEP]


def test_a_real_agent_reports_the_finding_and_refuses_the_launch_before_any_rank_loads(tmp_path):
    """A mis-keyed checkpoint on a real agent: `meshctl doctor` fails naming the key and the fix, and a start
    request is refused with the finding (400), no rank spawned."""
    model = write_checkpoint(tmp_path / "miskeyed", config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)}),
                             v4())
    (model / "tokenizer.json").write_text("{}")
    (agent,) = make_agents(tmp_path, 1)
    agent.start()
    try:
        mesh = write_mesh(tmp_path, [agent], model)
        r = meshctl(mesh, "doctor", "--json")
        checks = {(c["name"], c["ok"]): c for c in json.loads(r.stdout)}
        failed = checks[("checkpoint", False)]
        assert r.returncode == 1 and failed["node"] == "mesh", r.stdout
        assert failed["detail"].startswith("quantization.layers.0.attn.wq_a: 9 overrides in config.json's quantization "
                                           "are keyed by checkpoint tensor name")
        assert '"model.layers.0.attn.wq_a"' in failed["fix"]
        assert checks[("checkpoint", True)]["detail"].startswith("DSpark-capable: 3 stages")
        start = agent.post("/v1/ranks", {"generation": 1, "rank": 0, "world": 1, "profile": "meshd-rank",
                                         "model": str(model), "hostfile": ring_hostfile(1), "port": free_ports(1)[0],
                                         "ring_port": free_run(1), "args": {}})
        assert start.status_code == 400, start.text
        assert "the checkpoint will not load: quantization.layers.0.attn.wq_a:" in start.json()["error"]["message"]
        assert agent.ranks() == []
    finally:
        agent.kill()


def test_the_rank_names_the_same_layouts_and_points_undeclared_stages_at_the_config():
    stages = [n for n in v4() if n.startswith("mtp.")]
    assert ck.mtp_layout(stages) == "DSpark's 3 stages"
    assert ck.mtp_layout([n for n in v4(1, v3_head=True) if n.startswith("mtp.")]) == (
        "a V3-shaped MTP head (e_proj/h_proj)")
    unarmed = SimpleNamespace(**{m: None for m in OMLX.methods})
    assert drafter_off(OMLX, unarmed, stages) == (
        "drafter off, serving undrafted: the checkpoint holds DSpark's 3 stages but its config.json does not "
        "declare them (dspark_block_size, dspark_target_layer_ids); `meshctl doctor` names the fix")


@pytest.mark.parametrize("model_type,mlx_lm,takes", [
    ("deepseek_v4", "0.32.2", True),  # omlx's loader, whatever mlx-lm is under it
    ("qwen3_moe", "0.31.3", True),
    ("qwen3_moe", "0.32.2", False),  # reads a module's packing from its scales
    ("qwen3_moe", None, True),
])
def test_which_loader_gives_an_unnamed_module_the_default(model_type, mlx_lm, takes):
    assert ck.takes_default({"model_type": model_type}, mlx_lm) is takes


def test_a_config_the_check_cannot_read_is_said_not_crashed_on(tmp_path):
    odd = write_checkpoint(tmp_path / "odd", config(quantization={"group_size": "x", "bits": 4}), v4())
    [finding] = ck.survey(odd).findings
    assert finding.key == "config.json" and not finding.fatal and "was not checked" in finding.problem
    listed = write_checkpoint(tmp_path / "listed", config(), v4())
    (listed / "config.json").write_text("[]")
    [finding] = ck.survey(listed).findings
    assert finding.fatal and "it holds a JSON list, not an object" in finding.problem


def test_a_repo_is_checked_from_its_config_and_headers_before_it_is_downloaded(tmp_path, monkeypatch):
    """survey_repo over huggingface_hub's answers (its config.json, its safetensors headers by range request),
    played here by their own types: the same findings as on disk, and a repo without safetensors refused."""
    import huggingface_hub
    from huggingface_hub.errors import NotASafetensorsRepoError
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

    (tmp_path / "config.json").write_text(json.dumps(config(quantization={**MXFP4, **mxfp8_modules(lambda n: n)})))
    held = {n: TensorInfo(t.dtype, list(t.shape), (0, 0)) for n, t in v4().items()}
    files = {"model-00001-of-00001.safetensors": SafetensorsFileMetadata({}, held)}
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: str(tmp_path / name))
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", lambda repo: SafetensorsRepoMetadata(
        None, False, {n: next(iter(files)) for n in held}, files))
    report = ck.survey_repo("org/miskeyed")
    assert set(fatal(report)) == {"quantization.layers.0.attn.wq_a"} and report.tensors == len(v4())

    def gguf(repo):
        raise NotASafetensorsRepoError(f"{repo} is not a safetensors repo")
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", gguf)
    assert "org/gguf holds no safetensors weights" in ck.survey_repo("org/gguf").refusal()
