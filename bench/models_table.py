"""docs/MODELS.md from tests/models/test_families.py's own results: runs that file (its JUnit XML) and writes, for
every model family mlx-lm can shard, what each test proved on this machine; the sections after the table
(each under a `## ` heading: recipes written by hand) are kept as they are. Arguments go to pytest.

    .venv/bin/python bench/models_table.py"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from benchkit import ROOT

from kit.families import FAMILIES
from runtime.models.families import PADDING_BLIND, needs_of

BATCH = "test_four_concurrent_requests_answer_as_each_alone"
ONE_AT_A_TIME = "test_a_family_served_one_at_a_time_does_answer_otherwise_in_a_batch"
MESH = "test_through_agents_and_the_proxy_answers_are_the_single_process_answers"
# (column, test, the worlds it shows: their ids in the test's parameters)
COLUMNS = [
    ("TP2 = one process", "test_greedy_answers_are_the_single_process_answers", ("TP2",)),
    ("alone = mlx-lm", "test_greedy_answers_are_the_single_process_answers", ("alone",)),
    ("tape = fresh (TP2, alone)", "test_the_tape_answers_as_a_fresh_engine", ("TP2", "alone")),
    ("4 at once = alone (TP2, alone)", BATCH, ("TP2", "alone")),
    ("draft model (TP2, alone)", "test_drafted_answers_are_the_plain_answers", ("TP2", "alone")),
    ("drafted, 3 at once = alone (TP2, alone)", "test_prompts_sent_together_go_in_together_and_answer_as_each_alone",
     ("TP2", "alone")),
]


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Each test id ("name[params]") -> (passed | skipped | failed, the message)."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        verdict = ("passed", "")
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                verdict = ("skipped" if kind == "skipped" else "failed", found.get("message") or "")
        out[case.get("name")] = verdict
    return out


def table(results: dict[str, tuple[str, str]], caches: dict[str, list[str]], unbatchable: dict[str, list[str]]) -> str:
    """The Markdown table, a refusal's reason once as a numbered note under it."""
    notes: list[str] = []

    def cell(test: str, params: str) -> str:
        verdict, message = results.get(f"{test}[{params}]", ("not run", ""))
        if verdict == "skipped":
            family = params.rpartition("-")[2]
            reason = re.sub(r"^(Skipped: )?meshd-rank: ", "", message).replace(f"{family} models", "these models")
            reason = reason[:1].upper() + reason[1:]
            if reason not in notes:
                notes.append(reason)
            return f"refused ({notes.index(reason) + 1})"
        return {"passed": "yes", "failed": "**FAILS**"}.get(verdict, verdict)

    lines = ["| family | caches | " + " | ".join(c for c, _, _ in COLUMNS) + " | mesh with agents |",
             "|" + "---|" * (len(COLUMNS) + 3)]
    for family in FAMILIES:
        cells = []
        for _, test, worlds in COLUMNS:
            cells.append(", ".join(cell(test, f"{w}-{family}") for w in worlds))
            if test == BATCH and results.get(f"{ONE_AT_A_TIME}[{family}]", ("",))[0] == "passed":
                cells[-1] += f": one at a time ({PADDING_BLIND[family]} when batched)"
            elif test == BATCH and unbatchable[family]:
                cells[-1] += f": one at a time (its {', '.join(unbatchable[family])} cannot be merged)"
        mesh = [f"{nodes} node{'s' * (nodes != '1')}: {cell(MESH, f'{family}-{nodes}')}"
                for nodes in ("1", "2") if f"{MESH}[{family}-{nodes}]" in results]
        lines.append(f"| {family} | {', '.join(caches[family])} | " + " | ".join(cells) + f" | {'; '.join(mesh)} |")
    return "\n".join(lines + [""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)])


def main() -> None:
    import mlx.core as mx
    import mlx_lm

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "families.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        "tests/models/test_families.py", *sys.argv[1:]], cwd=ROOT)
        results = outcomes(junit)
    needs = {f: needs_of(config) for f, config in FAMILIES.items()}
    caches = {f: sorted(n.caches) for f, n in needs.items()}
    unbatchable = {f: sorted(n.unbatchable) for f, n in needs.items()}
    device = "Metal" if mx.metal.is_available() else f"{platform.system()} {platform.machine()}, no Metal"
    doc = ROOT / "docs" / "MODELS.md"
    _, heading, written_by_hand = doc.read_text().partition("\n## ") if doc.exists() else ("", "", "")
    doc.write_text(f"""# Model families

Every model family mlx-lm {mlx_lm.__version__} can shard (its `Model` has `shard()`), as
tests/models/test_families.py proves it on a tiny random model built from mlx-lm's own class (tests/kit/families.py:
two layers, one of each kind where a family mixes kinds, sliding windows of 8 tokens under prompts of 9 to 30). Written by
`.venv/bin/python bench/models_table.py`, which runs that file; this run: mlx {mx.__version__}, {device}.

- **TP2 = one process**: loaded and sharded through meshd-rank's load path on two ring ranks, a fresh engine's
  greedy answers are mlx-lm's single-process greedy decoding of the whole model (a flip of a near-tie within
  1e-4 in log probability passes as TP's summation order). **alone**: the same at world 1.
- **tape = fresh**: the same prompt again, one sharing its first 12 tokens and one extending its answer, after
  it on one engine: each answered exactly as a fresh engine answers it.
- **4 at once = alone**: one request, then three more joining it after its first token: each answer is the one
  it gets alone.
- **draft model**: speculative decoding with a draft model (`--draft-model`), greedy: plain decoding's answers,
  whatever the family's caches (a verify's writes are undone exactly, a sliding window's and a recurrent
  state's too: runtime/prefix/rollback.py). None of these families has an MTP head in stock mlx-lm (it drops `mtp.*` at load; docs/RUNTIME.md, model
  overlays).
- **drafted, 3 at once = alone**: three requests sent at once to the drafting engine with a draft model, two of
  them as long: those two go in in one forward, their caches merged and taken back out, and each answer is the
  one it gets alone (a family served one request at a time has no caches merged).
- **mesh with agents**: agents, the controller and meshd-proxy on loopback (`meshctl up`): a conversation,
  its repeat, another question after the same system prompt, its next turn, and four questions at once through
  the proxy, each answered as mlx-lm's single process answers it.

A refusal is meshd-rank's own, at load (runtime/models/families.py): the rank exits 1 naming why and the way out.

{table(results, caches, unbatchable)}
""" + (heading + written_by_hand if heading else ""))
    print(doc)


if __name__ == "__main__":
    main()
