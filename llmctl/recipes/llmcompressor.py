"""llm-compressor's recipe syntax, read as an llmctl recipe for the modifiers llmctl implements.

Owns: `translate(doc) -> (our document, origins)`. Their file is a mapping of `*_stage` sections
(`run_type: oneshot` only), each holding `*_modifiers` mappings of modifier name -> arguments:

    SparseGPTModifier, WandaPruningModifier -> stage sparsify (sparsegpt, wanda):
        sparsity, mask_structure ("2:4"; "0:0" is unstructured), targets, ignore,
        dampening_frac (SparseGPT), block_size
    GPTQModifier -> quantize gptq; AWQModifier (alone, or with a QuantizationModifier that gives
    the scheme) -> quantize awq; QuantizationModifier alone -> quantize rtn:
        targets, ignore, scheme (W4A16, W4A16_ASYM, W8A16: 128-column groups; W8A8: int8
        weights per channel and int8 activations per token, GPTQ or RTN) or one of
        config_groups' weights {num_bits, type: int, symmetric, strategy: group|channel,
        group_size, actorder, observer}, dampening_frac and actorder (GPTQ), block_size
    SmoothQuantModifier (beside a W8A8 GPTQModifier or QuantizationModifier) -> quantize's
        smoothquant: smoothing_strength (default 0.5, llm-compressor's), ignore; mappings only
        as llm-compressor's defaults (left out)

Any other modifier, another activation scheme (FP8...) or a target other than the decoder's
linear layers is refused by name. `lm_head` in `ignore` is dropped: llmctl never compresses it.
`origins` maps each of our keys to the key of their file it came from, for error messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from llmctl.errors import UsageError
from llmctl.recipes.schema import _WANT_TYPE, FORMAT_KEY, FORMAT_VERSION

SPARSITY = {"SparseGPTModifier": "sparsegpt", "WandaPruningModifier": "wanda"}
QUANT = {"GPTQModifier": "gptq", "AWQModifier": "awq", "QuantizationModifier": "rtn"}
SCHEMES = {"W4A16": (4, True), "W4A16_ASYM": (4, False), "W8A16": (8, True)}  # (bits, symmetric)
SCHEME_GROUP = 128  # compressed-tensors' preset schemes quantize groups of 128 columns
W8A8 = {"scheme": "w8a8", "bits": 8, "symmetric": True, "group_size": "channel"}
SMOOTH = "SmoothQuantModifier"
SMOOTH_STRENGTH = 0.5  # SmoothQuantModifier's default smoothing_strength
ALL_LINEARS = ("Linear", "re:model.layers.\\d*$", "re:model.layers.\\d+$")
LM_HEAD = ("lm_head", "re:.*lm_head", "re:.*lm_head.*", "re:lm_head", "re:.*lm_head$")
IGNORED_TOP = ("version", "metadata")
ACT_ORDER_ON = ("static", "weight", "group", True)


class _Lc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Weights(_Lc):
    num_bits: int
    type: str = "int"
    symmetric: bool = True
    strategy: str = "group"
    group_size: int | None = None
    actorder: str | bool | None = None
    observer: str | None = None
    dynamic: bool = False


class _Group(_Lc):
    weights: _Weights
    targets: str | list[str] = "Linear"
    input_activations: None = None
    output_activations: None = None


class _Sparsity(_Lc):
    sparsity: float | None = None
    mask_structure: str = "0:0"
    targets: str | list[str] = "Linear"
    ignore: list[str] = []
    dampening_frac: float | None = None
    block_size: int | None = None
    sequential_update: bool | None = None


class _Quant(_Lc):
    targets: str | list[str] = "Linear"
    ignore: list[str] = []
    scheme: str | None = None
    config_groups: dict[str, _Group] | None = None
    dampening_frac: float | None = None
    actorder: str | bool | None = None
    block_size: int | None = None
    sequential_update: bool | None = None


class _Smooth(_Lc):
    smoothing_strength: float = SMOOTH_STRENGTH
    mappings: None = None
    ignore: list[str] = []
    num_calibration_steps: int | None = None


def _parse(cls: type[_Lc], args: Any, where: str) -> Any:
    try:
        return cls.model_validate({} if args is None else args)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"] if isinstance(p, str) and p not in ("str",))
        at = f"{where}.{key}" if key else where
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(cls.model_fields)
            raise UsageError(f"recipe {at}: unknown key; llmctl reads: {allowed}") from None
        want = _WANT_TYPE.get(err["type"])
        text = f"must be {want}" if want else err["msg"].replace("Input should be", "must be")
        raise UsageError(f"recipe {at}: {text}, got {err.get('input')!r}") from None


def _targets(targets: str | list[str], where: str) -> None:
    names = [targets] if isinstance(targets, str) else targets
    bad = [t for t in names if t not in ALL_LINEARS]
    if bad or not names:
        raise UsageError(
            f"recipe {where}.targets: {bad[0] if bad else '[]'!r}: llmctl compresses every "
            "linear layer of the decoder (targets: Linear); leave layers out with ignore"
        )


def _ignore(patterns: list[str]) -> list[str]:
    return [p for p in patterns if p not in LM_HEAD]


def _sparsify(name: str, args: Any, where: str, origins: dict[str, str]) -> dict:
    a: _Sparsity = _parse(_Sparsity, args, where)
    _targets(a.targets, where)
    if a.sequential_update is False:
        raise UsageError(f"recipe {where}.sequential_update: llmctl always calibrates in sequence")
    out: dict[str, Any] = {"method": SPARSITY[name], "ignore": _ignore(a.ignore)}
    origins["stages.sparsify"] = where
    n, _, m = a.mask_structure.partition(":")
    if a.mask_structure not in ("0:0", "") and not (n.isdigit() and m.isdigit()):
        raise UsageError(f"recipe {where}.mask_structure: expected N:M, got {a.mask_structure!r}")
    if a.mask_structure not in ("0:0", ""):
        if a.sparsity is not None and abs(a.sparsity - int(n) / int(m)) > 1e-9:
            raise UsageError(
                f"recipe {where}.sparsity: {a.sparsity} with mask_structure {a.mask_structure} "
                f"(which prunes {int(n) / int(m):g}); llmctl prunes the pattern exactly"
            )
        out["pattern"] = a.mask_structure
        origins["stages.sparsify.pattern"] = f"{where}.mask_structure"
    elif a.sparsity is None:
        raise UsageError(f"recipe {where}.sparsity: required without an N:M mask_structure")
    else:
        out["sparsity"] = a.sparsity
    if a.dampening_frac is not None:
        if name != "SparseGPTModifier":
            raise UsageError(f"recipe {where}.dampening_frac: only SparseGPTModifier takes it")
        out["dampening"] = a.dampening_frac
    if a.block_size is not None:
        out["column_block"] = a.block_size
    for ours, theirs in (("sparsity", "sparsity"), ("dampening", "dampening_frac"),
                         ("column_block", "block_size"), ("ignore", "ignore")):  # fmt: skip
        origins[f"stages.sparsify.{ours}"] = f"{where}.{theirs}"
    return out


def _scheme(a: _Quant, where: str) -> dict:
    """bits, symmetric, group_size (and act_order, observer) from `scheme` or `config_groups`."""
    if (a.scheme is None) == (a.config_groups is None):
        raise UsageError(f"recipe {where}: give one of scheme (W4A16, W8A16...) or config_groups")
    if a.scheme == "W8A8":
        return dict(W8A8)
    if a.scheme is not None:
        if a.scheme not in SCHEMES:
            raise UsageError(
                f"recipe {where}.scheme: {a.scheme} is not an integer scheme llmctl writes; use "
                f"one of {', '.join(SCHEMES)} or W8A8"
            )
        bits, sym = SCHEMES[a.scheme]
        return {"bits": bits, "symmetric": sym, "group_size": SCHEME_GROUP}
    if len(a.config_groups or {}) != 1:
        raise UsageError(f"recipe {where}.config_groups: llmctl reads exactly one group")
    gname, group = next(iter((a.config_groups or {}).items()))
    at = f"{where}.config_groups.{gname}"
    _targets(group.targets, at)
    w = group.weights
    if w.type != "int" or w.dynamic:
        raise UsageError(f"recipe {at}.weights.type: llmctl writes static integer weights only")
    if w.strategy not in ("group", "channel"):
        raise UsageError(f"recipe {at}.weights.strategy: group or channel, got {w.strategy!r}")
    if w.strategy == "group" and w.group_size is None:
        raise UsageError(f"recipe {at}.weights.group_size: required with strategy group")
    out: dict[str, Any] = {"bits": w.num_bits, "symmetric": w.symmetric}
    out["group_size"] = "channel" if w.strategy == "channel" else w.group_size
    if w.actorder is not None:
        out["act_order"] = w.actorder in ACT_ORDER_ON
    if w.observer is not None:
        out["observer"] = "minmax" if w.observer.endswith("minmax") else w.observer
    return out


def _quantize(mods: dict[str, Any], where: str, origins: dict[str, str]) -> dict:
    names = list(mods)
    awq_rtn = sorted(names) == ["AWQModifier", "QuantizationModifier"]
    if len(names) > 1 and not awq_rtn:
        raise UsageError(
            f"recipe {where}: {' and '.join(names)} in one run; llmctl quantizes every layer with "
            "one method (AWQModifier may come with the QuantizationModifier that gives its scheme)"
        )
    parsed = {n: _parse(_Quant, mods[n], f"{where}.{n}") for n in names}
    for n, a in parsed.items():
        _targets(a.targets, f"{where}.{n}")
    method = "awq" if "AWQModifier" in parsed else QUANT[names[0]]
    given = [n for n, a in parsed.items() if a.scheme is not None or a.config_groups]
    main = given[0] if given else names[0]
    a = parsed[main]
    at = f"{where}.{main}"
    out: dict[str, Any] = {"method": method, **_scheme(a, at)}
    origins["stages.quantize"] = at
    out["ignore"] = _ignore([p for x in parsed.values() for p in x.ignore])
    for key, value in (("dampening", a.dampening_frac), ("act_order", a.actorder)):
        if value is not None and method != "gptq":
            raise UsageError(f"recipe {at}: {key} applies to GPTQModifier only")
    if a.dampening_frac is not None:
        out["dampening"] = a.dampening_frac
    if a.actorder is not None:
        out["act_order"] = a.actorder in ACT_ORDER_ON
    if a.block_size is not None:
        out["column_block"] = a.block_size
    for ours in ("bits", "symmetric", "group_size", "scheme"):
        origins[f"stages.quantize.{ours}"] = f"{at}.{'scheme' if a.scheme else 'config_groups'}"
    for ours, theirs in (("dampening", "dampening_frac"), ("act_order", "actorder"),
                         ("column_block", "block_size"), ("ignore", "ignore")):  # fmt: skip
        origins[f"stages.quantize.{ours}"] = f"{at}.{theirs}"
    return out


def _smooth(args: Any, where: str, quantize: dict | None, origins: dict[str, str]) -> None:
    """SmoothQuantModifier's settings into the quantize stage (which must be W8A8)."""
    a: _Smooth = _parse(_Smooth, args, where)
    if quantize is None or quantize.get("scheme") != "w8a8":
        raise UsageError(
            f"recipe {where}: SmoothQuant prepares int8 activations; llmctl runs it before a "
            "W8A8 GPTQModifier or QuantizationModifier in the same modifiers"
        )
    if not 0 <= a.smoothing_strength <= 1:
        raise UsageError(
            f"recipe {where}.smoothing_strength: in [0, 1], got {a.smoothing_strength}"
        )
    quantize.update(smoothquant=True, smoothquant_strength=a.smoothing_strength)
    quantize["ignore"] = sorted({*quantize.get("ignore", []), *_ignore(a.ignore)})
    origins["stages.quantize.smoothquant_strength"] = f"{where}.smoothing_strength"


def _modifier_groups(doc: dict):
    """(stage name, modifiers key, {modifier: args}) in file order."""
    for stage, body in doc.items():
        if stage in IGNORED_TOP:
            continue
        if not str(stage).endswith("_stage"):
            raise UsageError(f"recipe {stage}: unknown key in an llm-compressor recipe")
        if not isinstance(body, dict):
            raise UsageError(f"recipe {stage}: must be a mapping of keys to values")
        for key, mods in body.items():
            if key == "run_type":
                if mods != "oneshot":
                    raise UsageError(
                        f"recipe {stage}.run_type: {mods!r}; llmctl runs oneshot stages only"
                    )
                continue
            if not str(key).endswith("_modifiers") or not isinstance(mods, dict):
                raise UsageError(
                    f"recipe {stage}.{key}: expected a `*_modifiers` mapping of modifiers"
                )
            yield stage, key, mods


def translate(doc: dict) -> tuple[dict, dict[str, str]]:
    """(the recipe in llmctl's format, our key path -> theirs)."""
    stages: dict[str, Any] = {}
    origins: dict[str, str] = {}
    smooth: list[tuple[Any, str]] = []
    for stage, key, mods in _modifier_groups(doc):
        where = f"{stage}.{key}"
        for name in mods:
            if name not in SPARSITY and name not in QUANT and name != SMOOTH:
                supported = ", ".join((*SPARSITY, *QUANT, SMOOTH))
                raise UsageError(
                    f"recipe {where}.{name}: llmctl does not implement {name}; it reads {supported}"
                )
        sparse = [n for n in mods if n in SPARSITY]
        quant = {n: a for n, a in mods.items() if n in QUANT}
        if len(sparse) > 1 or (sparse and "sparsify" in stages):
            raise UsageError(f"recipe {where}: more than one pruning modifier")
        if quant and "quantize" in stages:
            raise UsageError(f"recipe {where}: a second quantization; llmctl quantizes once")
        if sparse and "quantize" in stages:
            raise UsageError(f"recipe {where}: pruning after quantization; prune first")
        if sparse:
            name = sparse[0]
            stages["sparsify"] = _sparsify(name, mods[name], f"{where}.{name}", origins)
        if quant:
            stages["quantize"] = _quantize(quant, where, origins)
        if SMOOTH in mods:  # applied once the quantization is known (it may come later)
            smooth.append((mods[SMOOTH], f"{where}.{SMOOTH}"))
    for args, where in smooth:
        _smooth(args, where, stages.get("quantize"), origins)
    if not stages:
        raise UsageError("recipe: no modifier llmctl implements (e.g. GPTQModifier)")
    return {FORMAT_KEY: FORMAT_VERSION, "stages": stages}, origins
