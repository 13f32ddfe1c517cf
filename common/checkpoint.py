"""A checkpoint checked before any rank loads it, from config.json, the weight index and each .safetensors
file's JSON header (8-byte length, then the header): no tensor is read, so a 160 GB model is judged in
seconds. What fails a load late or silently is named with its config key and the fix:

- quantization overrides that resolve to no module (keyed by checkpoint tensor name, `layers.0.attn.wq_a`,
  where mlx-lm's `nn.quantize` asks by module path, `model.layers.0.attn.wq_a`): those modules take the
  default and the load fails on their packed shapes;
- a module packed otherwise than the quantization its config gives it;
- whether the checkpoint drafts with DeepSeek's DSpark stages (`mtp.*`, which community conversions strip),
  said once with why, and its stage count against the config's fields (`num_nextn_predict_layers: 1` is the
  V3 field; DSpark's loader reads `n_mtp_layers`);
- weight shapes against the config: vocabulary, hidden size, layers, routed experts, DSpark's fused width.

Module paths are the checkpoint's names as the family's `sanitize` renames them (DeepSeek-V4's, as omlx ships
it: `layers.N` → `model.layers.N`, `embed` → `model.embed_tokens`, `head` → `lm_head`, per-expert `w1/w2/w3`
stacked into `switch_mlp`); an MLX-format checkpoint is already named by module path.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

HEADER_MAX = 100 << 20  # bytes a safetensors header may claim before it is taken for a corrupt file
SHOWN = 3  # keys named in a finding that covers many


@dataclass(frozen=True)
class Tensor:
    dtype: str  # the safetensors dtype: "U32", "U8", "BF16", ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Finding:
    key: str  # the config key, or the tensor, the finding is about
    problem: str
    fix: str
    fatal: bool  # the load fails on it

    def line(self) -> str:
        return f"{self.key}: {self.problem}; fix: {self.fix}"


@dataclass(frozen=True)
class Drafting:
    """Whether the checkpoint drafts with DSpark's stages, and why (said once, where MTP is in question)."""

    dspark: bool
    why: str
    fix: str = ""


class CheckpointError(Exception):
    """The checkpoint's files cannot be read as a checkpoint: names the file and what is wrong."""


# --- reading: the index and the headers -------------------------------------------------------------------

def header(path: Path) -> dict[str, Tensor]:
    """The tensors one .safetensors file holds, from its header alone."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= HEADER_MAX:
                raise CheckpointError(f"{path.name} is not a safetensors file (its header claims {size} bytes)")
            raw = f.read(size)
    except OSError as e:
        raise CheckpointError(f"{path.name} cannot be read: {e.strerror or e}") from None
    try:
        entries = json.loads(raw)
        return {name: Tensor(str(e["dtype"]), tuple(int(n) for n in e["shape"]))
                for name, e in entries.items() if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path.name}'s safetensors header is not valid ({type(e).__name__}: {e}): the file "
                              "is truncated or not safetensors") from None


def tensors(model_dir: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint at `model_dir`: the files its index names (every *.safetensors without
    one), each file's header. An index that names a file that is not there, or a tensor its file lacks, is a
    CheckpointError (a download cut short)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        out: dict[str, Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            out.update(header(f))
        return out
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index.name} cannot be read as an index ({type(e).__name__}: {e})") from None
    out = {}
    for name in sorted(set(weight_map.values())):
        if not (model_dir / name).is_file():
            raise CheckpointError(f"{index.name} names {name}, which is not in {model_dir}: the download is "
                                  "incomplete")
        out.update(header(model_dir / name))
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise CheckpointError(f"{len(missing)} tensors the index names are in no file's header ({missing[0]} in "
                              f"{weight_map[missing[0]]}): the file is not the one the index was written for")
    return out


# --- module paths ------------------------------------------------------------------------------------------

DEEPSEEK_V4_TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
DEEPSEEK_V4_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.(w[123])$")
SHARED = re.compile(r"\.shared_experts\.(w[123])$")
LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")
EXPERTS = re.compile(r"(.*\.experts)\.(\d+)\.")
STAGE = re.compile(r"mtp\.(\d+)\.")


def module_path(module: str, model_type: str) -> str:
    """The module path mlx-lm's loader gives a checkpoint module (a tensor name less its last part)."""
    if not model_type.startswith("deepseek_v4"):
        return module
    if module in DEEPSEEK_V4_TOP:
        return DEEPSEEK_V4_TOP[module]
    if module.startswith("layers."):
        module = "model." + module
    module = EXPERT.sub(lambda m: f".ffn.switch_mlp.{DEEPSEEK_V4_W[m.group(1)]}", module)
    return SHARED.sub(lambda m: f".shared_experts.{DEEPSEEK_V4_W[m.group(1)]}", module)


@dataclass(frozen=True)
class Module:
    path: str  # the module path
    name: str  # its first checkpoint name
    weight: Tensor
    scales: Tensor | None  # packed: its scales
    copies: int  # checkpoint modules stacked into it (routed experts stored one by one)


def modules(checkpoint: dict[str, Tensor], model_type: str) -> dict[str, Module]:
    """The checkpoint's modules with a weight, by module path."""
    out: dict[str, Module] = {}
    for name in sorted(checkpoint):
        if not name.endswith(".weight"):
            continue
        module = name[:-len(".weight")]
        path = module_path(module, model_type)
        seen = out.get(path)
        out[path] = Module(path, seen.name if seen else module, checkpoint[name], checkpoint.get(module + ".scales"),
                           seen.copies + 1 if seen else 1)
    return out


# --- the checks: each a pure function of the config and the tensors ----------------------------------------

def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def _field(config: dict, *names: str):
    """The first of `names` the config (or its text_config) sets."""
    for where in (config, config.get("text_config") or {}):
        for name in names:
            if where.get(name) is not None:
                return where[name]
    return None


def _spec(q: dict) -> str:
    return f"{q.get('mode', 'affine')} ({q['bits']}-bit, group {q['group_size']})"


def _packing(m: Module, q: dict) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the weight shape `q` makes of this module, the shape the checkpoint holds) when they differ."""
    inputs = m.scales.shape[-1] * int(q["group_size"])
    want = m.weight.shape[:-1] + (inputs * int(q["bits"]) // 32,)
    if m.copies > 1:
        return ((m.copies,) + want, (m.copies,) + m.weight.shape) if want != m.weight.shape else None
    return (want, m.weight.shape) if want != m.weight.shape else None


def packed_as(m: Module, group_size: int) -> dict:
    """The quantization the checkpoint's packing of `m` says (bits from its lanes against its scales; the
    mx formats by their uint8 scales)."""
    bits = m.weight.shape[-1] * 32 // (m.scales.shape[-1] * group_size)
    mx = {(4, 32): "mxfp4", (8, 32): "mxfp8", (4, 16): "nvfp4"}.get((bits, group_size))
    return {"group_size": group_size, "bits": bits, "mode": mx if m.scales.dtype == "U8" and mx else "affine"}


def check_quantization(config: dict, mods: dict[str, Module], names: set[str], takes_default: bool) -> list[Finding]:
    """Overrides that resolve to no module, and modules packed otherwise than the quantization they get.
    `takes_default`: the loader gives a module its override or else the default (omlx's DeepSeek-V4 loader,
    mlx-lm before 0.32), rather than reading its packing from its scales."""
    q = config.get("quantization")
    if not isinstance(q, dict) or not {"group_size", "bits"} <= set(q):
        return []
    default = {k: q[k] for k in ("group_size", "bits", "mode") if k in q}
    overrides = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}
    dead = [k for k in overrides if k not in mods]
    # a checkpoint-name key whose module path is keyed too (the published fix carries both spellings) is inert
    model_type = str(config.get("model_type", ""))
    by_name = {n[:-len(".weight")]: mods[module_path(n[:-len(".weight")], model_type)]
               for n in names if n.endswith(".weight")}
    miskeyed = [k for k in dead if k in by_name and by_name[k].path not in overrides]
    nowhere = [k for k in dead if k not in by_name]
    out = []
    if miskeyed:
        wrong = [(k, _packing(by_name[k], default)) for k in miskeyed
                 if isinstance(overrides[k], dict) and by_name[k].scales is not None]
        wrong = [(k, shapes) for k, shapes in wrong if shapes]
        paths = [f"{k} → {by_name[k].path}" for k in miskeyed]
        problem = (f"{len(miskeyed)} overrides in config.json's quantization are keyed by checkpoint tensor name, "
                   f"not module path ({_shown(paths)}), so they resolve to no module")
        if wrong and takes_default:
            k, (want, got) = wrong[0]
            problem += (f": {len(wrong)} modules packed {_spec(overrides[k])} fall back to the default "
                        f"{_spec(default)} and the load fails with \"Expected shape {want} but received shape "
                        f"{got} for parameter {by_name[k].path}.weight\"")
        elif wrong:
            problem += ("; mlx-lm reads those modules' packing from their scales, so it loads here, but omlx's "
                        "loader and mlx-lm before 0.32 give them the default and fail")
        out.append(Finding(f"quantization.{miskeyed[0]}", problem,
                           f"key each override by its module path (\"{by_name[miskeyed[0]].path}\"), or carry both "
                           "spellings; a corrected revision of the checkpoint does: pull it again",
                           bool(wrong) and takes_default))
    if nowhere:
        out.append(Finding(f"quantization.{nowhere[0]}",
                           f"{len(nowhere)} overrides in config.json's quantization name no module of the checkpoint "
                           f"({_shown(nowhere)}): they quantize nothing",
                           "remove them, or key them by the module paths of the checkpoint's modules", False))
    lost = {by_name[k].path for k in miskeyed}  # said above
    misfit = []  # (module, the quantization it is given, whether an override names it)
    for m in mods.values():
        given = overrides.get(m.path)
        if m.scales is None or m.path in lost or given is False or (given is None and not takes_default):
            continue
        spec = given if isinstance(given, dict) else default
        if _packing(m, spec):
            misfit.append((m, spec, given is not None))
    if misfit:
        m, spec, named = misfit[0]
        want, got = _packing(m, spec)
        out.append(Finding(f"quantization.{m.path}",
                           f"{len(misfit)} modules are packed otherwise than config.json's quantization gives them "
                           f"({_shown([x.path for x, _, _ in misfit])}; {m.path} is given "
                           f"{'its override' if named else 'the default'} {_spec(spec)}): the load fails with "
                           f"\"Expected shape {want} but received shape {got} for parameter {m.path}.weight\"",
                           "key an override per module by its module path, as the checkpoint is packed: "
                           f"\"{m.path}\": {json.dumps(packed_as(m, int(spec['group_size'])))}", True))
    return out


def mtp_stages(names) -> list[int]:
    """The MTP stages the checkpoint holds (`mtp.N.*`)."""
    return sorted({int(m.group(1)) for n in names if (m := STAGE.match(n))})


def mtp_layout(names: list[str]) -> str:
    """What the checkpoint's `mtp.*` tensors are, in words."""
    if not names:
        return "no MTP tensors"
    if any(".e_proj." in n or ".h_proj." in n for n in names):
        return "a V3-shaped MTP head (e_proj/h_proj)"
    if any(".main_proj." in n for n in names):
        return f"DSpark's {len(mtp_stages(names))} stages"
    return f"{len(names)} MTP tensors in another layout"


def is_dspark(config: dict) -> bool:
    """The config declares an embedded DSpark drafter (omlx's discriminator)."""
    return bool(int(config.get("dspark_block_size") or 0) and config.get("dspark_target_layer_ids"))


def stage_count(config: dict) -> int:
    """The DSpark stages a DSpark-aware loader builds: `n_mtp_layers`, else one per target layer."""
    return int(config.get("n_mtp_layers") or 0) or len(config.get("dspark_target_layer_ids") or ())


KEEP = ("use a conversion that keeps the mtp.* tensors (look for mtp. keys in its model.safetensors.index.json "
        "before downloading)")
DSPARK = ("use a DeepSeek-V4 DSpark checkpoint (its mtp.* stages: mtp.0.main_proj over the target layers' taps, a "
          "Markov head in the last), with dspark_* fields in its config.json")


def check_mtp(config: dict, checkpoint: dict[str, Tensor],
              mods: dict[str, Module]) -> tuple[Drafting | None, list[Finding]]:
    """Whether a DeepSeek-V4 checkpoint drafts with DSpark, and its stage counts and fused width against the
    config. Nothing is said of another family."""
    if not (str(config.get("model_type", "")).startswith("deepseek_v4") or is_dspark(config)):
        return None, []
    mtp = [n for n in checkpoint if n.startswith("mtp.")]
    stages, layout = mtp_stages(mtp), mtp_layout(mtp)
    span = f"mtp.{stages[0]}-{stages[-1]}" if stages else "mtp.*"
    nextn = int(config.get("num_nextn_predict_layers") or 0)
    stage_tensors = any(".main_proj." in n for n in mtp)
    if not is_dspark(config):
        if stage_tensors:
            return Drafting(False, f"the checkpoint holds {layout} but config.json declares no DSpark drafter"), [
                Finding("dspark_block_size",
                        f"the checkpoint holds {layout} ({span}) but config.json lacks dspark_block_size and "
                        f"dspark_target_layer_ids, so with MTP on (omlx's overlay) the loader builds "
                        f"num_nextn_predict_layers={nextn} V3-shaped heads (e_proj/h_proj) and the load fails on "
                        "the stages' tensors",
                        "copy dspark_block_size, dspark_target_layer_ids, dspark_noise_token_id, dspark_markov_rank "
                        "and n_mtp_layers from the checkpoint's inference/config.json into config.json", True)]
        out = []
        if stages and nextn and len(stages) != nextn:
            out.append(Finding("num_nextn_predict_layers",
                               f"is {nextn} but the checkpoint holds {len(stages)} MTP heads ({span}): with MTP on "
                               f"(omlx's overlay) the loader builds {nextn} and the load fails on the others",
                               f"set num_nextn_predict_layers to {len(stages)}", True))
        if mtp:
            return Drafting(False, f"the checkpoint holds {layout}, not DSpark's stages", DSPARK), out
        return Drafting(False, "the checkpoint holds no mtp.* tensors (community conversions strip them) and "
                               "config.json declares no DSpark drafter", KEEP), out
    want, targets = stage_count(config), list(config["dspark_target_layer_ids"])
    if not mtp:
        return Drafting(False, f"config.json declares DSpark (dspark_block_size {config['dspark_block_size']}, "
                               f"dspark_target_layer_ids {targets}) but the checkpoint holds no mtp.* tensors: the "
                               "conversion stripped them, so DSpark is inert", KEEP), []
    out = []
    if len(stages) != want:
        field = "n_mtp_layers" if config.get("n_mtp_layers") else "dspark_target_layer_ids"
        out.append(Finding(field, f"makes {want} DSpark stages but the checkpoint holds {len(stages)} ({span}): the "
                                  f"DSpark loader builds {want} and the load fails on the stages' tensors",
                           f"set n_mtp_layers to {len(stages)} (the checkpoint's inference/config.json has it)", True))
    hidden = _field(config, "hidden_size", "dim")
    fused = mods.get("mtp.0.main_proj")
    inputs = _inputs(fused, config) if fused else None
    if hidden and inputs and inputs != hidden * len(targets):
        out.append(Finding("dspark_target_layer_ids",
                           f"names {len(targets)} target layers, so stage 0's main_proj takes {len(targets)} x "
                           f"hidden_size {hidden} = {hidden * len(targets)} inputs, but mtp.0.main_proj is {inputs} "
                           "wide: the load fails on its shape",
                           "set dspark_target_layer_ids to the layers the checkpoint was trained on (its "
                           "inference/config.json has them)", True))
    if not stage_tensors:
        return Drafting(False, f"config.json declares DSpark but the checkpoint holds {layout}", DSPARK), out
    v3 = (f"; num_nextn_predict_layers {nextn} is the V3 field: a V3-shaped MTP loader (an omlx without DSpark) "
          f"builds {nextn} e_proj/h_proj head(s) and will not load these stages, DSpark's loader reads "
          "n_mtp_layers" if nextn and nextn != len(stages) else "")
    return Drafting(True, f"DSpark-capable: {len(stages)} stages ({span}), stage 0's main_proj over layers "
                          f"{targets}, blocks of {config['dspark_block_size']}{v3}"), out


def _inputs(m: Module, config: dict) -> int | None:
    """A module's input width: its weight's last dimension, or its scales' times the group size when packed."""
    if m.scales is None:
        return m.weight.shape[-1]
    q = config.get("quantization") or {}
    spec = q.get(m.path) if isinstance(q.get(m.path), dict) else q
    return m.scales.shape[-1] * int(spec["group_size"]) if "group_size" in spec else None


def check_shapes(config: dict, checkpoint: dict[str, Tensor], mods: dict[str, Module]) -> list[Finding]:
    """The embedding and output head against vocab_size and hidden_size, the layers against
    num_hidden_layers, each layer's routed experts against n_routed_experts."""
    out = []
    vocab, hidden = _field(config, "vocab_size"), _field(config, "hidden_size", "dim")
    ends = [(what, m) for path, what in (("model.embed_tokens", "the embedding"), ("lm_head", "the output head"))
            if (m := mods.get(path)) is not None]
    for key, want, held, says in (("vocab_size", vocab, lambda m: m.weight.shape[0], "holds {} rows"),
                                  ("hidden_size", hidden, lambda m: _inputs(m, config), "is {} wide")):
        wrong = [f"{what} ({m.name}.weight) {says.format(held(m))}" for what, m in ends
                 if want and held(m) is not None and held(m) != want]
        if wrong:
            got = held(next(m for _, m in ends if held(m) != want))
            out.append(Finding(key, f"is {want} but {' and '.join(wrong)}: the load fails on its shape",
                               f"set {key} to {got}, or use the config this checkpoint came with", True))
    layers = _field(config, "num_hidden_layers", "n_layers")
    held = {int(m.group(1)) for n in checkpoint if (m := LAYER.match(n))}
    if layers and held and max(held) + 1 < layers:
        out.append(Finding("num_hidden_layers", f"is {layers} but the checkpoint holds layers 0-{max(held)}: layers "
                                                f"{max(held) + 1}-{layers - 1} are missing and the load fails",
                           f"set num_hidden_layers to {max(held) + 1}, or download the missing files", True))
    experts = _field(config, "n_routed_experts", "num_experts", "num_local_experts")
    if experts:
        counts = {}
        for n in checkpoint:
            if m := EXPERTS.match(n):
                counts.setdefault(m.group(1), set()).add(int(m.group(2)))
        per_layer = {k: len(v) for k, v in counts.items()}
        per_layer |= {m.path: m.weight.shape[0] for m in mods.values()
                      if ".switch_mlp." in m.path and m.copies == 1 and len(m.weight.shape) == 3}
        wrong = sorted(k for k, n in per_layer.items() if n != experts)
        if wrong:
            out.append(Finding("n_routed_experts", f"is {experts} but {_shown(wrong)} hold {per_layer[wrong[0]]} "
                                                   "experts: the load fails on their shapes",
                               f"set n_routed_experts to {per_layer[wrong[0]]}, or use the config this checkpoint "
                               "came with", True))
    return out


@dataclass(frozen=True)
class Report:
    findings: tuple[Finding, ...]
    drafting: Drafting | None
    tensors: int

    def refusal(self) -> str | None:
        """Why a rank must not load this checkpoint (its fatal findings), None when it may."""
        fatal = [f.line() for f in self.findings if f.fatal]
        return ("the checkpoint will not load: " + " | ".join(fatal)) if fatal else None

    def to_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings], "tensors": self.tensors,
                "drafting": asdict(self.drafting) if self.drafting else None}

    @classmethod
    def from_dict(cls, d: dict) -> Report:
        return cls(tuple(Finding(**f) for f in d["findings"]),
                   Drafting(**d["drafting"]) if d.get("drafting") else None, int(d["tensors"]))


def check(config: dict, checkpoint: dict[str, Tensor], takes_default: bool = True) -> Report:
    """Every finding on a checkpoint of `config` holding `checkpoint` (name → dtype and shape)."""
    mods = modules(checkpoint, str(config.get("model_type", "")))
    drafting, mtp = check_mtp(config, checkpoint, mods)
    findings = check_quantization(config, mods, set(checkpoint), takes_default) + mtp + check_shapes(
        config, checkpoint, mods)
    return Report(tuple(findings), drafting, len(checkpoint))


def takes_default(config: dict, mlx_lm: str | None) -> bool:
    """Whether this node's loader gives a module no override names the default quantization (rather than
    the packing its scales say, as mlx-lm 0.32 does): omlx's DeepSeek-V4 loader always, mlx-lm before 0.32,
    and an mlx-lm this machine does not have."""
    if str(config.get("model_type", "")).startswith("deepseek_v4") or not mlx_lm:
        return True
    try:
        return tuple(int(p) for p in mlx_lm.split(".")[:2]) < (0, 32)
    except ValueError:
        return True


def survey(model_dir: Path) -> Report:
    """The checkpoint at `model_dir` checked for this node's loader; one that cannot be read is a fatal
    finding of its own. Without a config.json nothing is said (whether the model is there is not this check's)."""
    if not (model_dir / "config.json").is_file():
        return Report((), None, 0)
    try:
        config = _object((model_dir / "config.json").read_text())
        checkpoint = tensors(model_dir)
    except (OSError, ValueError) as e:
        return Report((Finding("config.json", f"cannot be read ({e})", "download the model again", True),), None, 0)
    except CheckpointError as e:
        return Report((Finding("weights", str(e), "download the model again", True),), None, 0)
    return judged(config, checkpoint)


def survey_repo(repo: str) -> Report:
    """A Hugging Face repo's checkpoint checked before it is downloaded: its config.json, and its safetensors
    headers read by range requests (huggingface_hub's get_safetensors_metadata), in seconds."""
    from huggingface_hub import get_safetensors_metadata, hf_hub_download
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        config = _object(Path(hf_hub_download(repo, "config.json")).read_text())
        held = get_safetensors_metadata(repo).files_metadata.values()
    except ValueError as e:
        return Report((Finding("config.json", f"cannot be read ({e})", "use another revision of the checkpoint",
                               True),), None, 0)
    except OSError as e:  # the hub out of reach (offline mode, no network): the download is checked instead
        return Report((Finding("weights", f"not checked before the download: the hub cannot be reached ({e})",
                               "the downloaded copy is checked before it is copied to the other nodes", False),),
                      None, 0)
    except NotASafetensorsRepoError:
        return Report((Finding("weights", f"{repo} holds no safetensors weights, the only ones mlx-lm loads",
                               "use an MLX conversion of the model (safetensors)", True),), None, 0)
    return judged(config, {name: Tensor(t.dtype, tuple(t.shape)) for f in held for name, t in f.tensors.items()})


def _object(text: str) -> dict:
    config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError(f"it holds a JSON {type(config).__name__}, not an object")
    return config


def judged(config: dict, checkpoint: dict[str, Tensor]) -> Report:
    """`check` for this machine's loader; a config whose fields it cannot read is said, not crashed on."""
    try:
        version = metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        version = None
    try:
        return check(config, checkpoint, takes_default(config, version))
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError) as e:
        return Report((Finding("config.json", f"a field is not what its family's loader reads, so the checkpoint "
                                              f"was not checked ({type(e).__name__}: {e})",
                               "compare config.json with the config this checkpoint came with", False),),
                      None, len(checkpoint))
