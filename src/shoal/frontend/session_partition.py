"""A user's module cut on its features over the group's processes (SINGA's `partition_dim: 1` in a user's loop, issue 39,
point 1): which Linears torch's tensor parallelism can cut, and `run.model`'s cut (comm/tensor_parallel.py does it).

Two shapes are cut. A pair is Megatron's: a Linear cut column-wise (each process a slice of its output features), then
only element-wise modules, then a Linear cut row-wise (its input features sliced the same way, its outputs summed over
the group); only an `nn.Sequential` shows that order, elsewhere the user names the pair in torch's form. An attention
is cut by its heads, as torch's tensor-parallel tutorial cuts one: a module with a heads attribute (`n_head`,
`num_heads`, ...) whose own Linears are q, k and v (three, or one packing them) and then an output projection; q, k
and v are cut column-wise (each process its heads' rows of each), the projection row-wise, and the module's heads and
width attributes become the process's share (`attention_cut`, pure). Its forward must compute from those attributes,
not from its input's width: `cut` runs each attention on a probe input before and after its cut and refuses the one
whose output differs. What cannot be cut is refused in one line naming the module."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.nn as nn

from shoal.errors import ShoalError

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Dropout, nn.Identity)
HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nhead")
KV_HEADS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
WIDTHS = ("n_embd", "embed_dim", "hidden_size", "all_head_size", "d_model", "inner_dim")  # the heads' width, when equal
PROBE_ROWS, PROBE_TOKENS = 2, 5


class NothingToCut(ShoalError, ValueError):
    pass


def linear_pairs(module: nn.Module) -> Dict[str, str]:
    """{qualified Linear name: "colwise" | "rowwise"} for every Linear → element-wise → Linear run in the module's
    `nn.Sequential`s, the widths matching."""
    cuts: Dict[str, str] = {}
    for prefix, seq in module.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        i = 0
        while i < len(children):
            name, first = children[i]
            j = i + 1
            while j < len(children) and isinstance(children[j][1], ELEMENTWISE):
                j += 1
            if isinstance(first, nn.Linear) and j < len(children) and isinstance(children[j][1], nn.Linear) \
                    and children[j][1].in_features == first.out_features:
                base = f"{prefix}." if prefix else ""
                cuts[base + name], cuts[base + children[j][0]] = "colwise", "rowwise"
                i = j + 1
            else:
                i += 1
    return cuts


def _int(module: nn.Module, attr: str):
    value = getattr(module, attr, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def heads_of(module: nn.Module):
    """The module's number of heads (its first `HEADS` attribute holding an int), or None."""
    return next((value for value in map(lambda a: _int(module, a), HEADS) if value is not None), None)


def _linears(module: nn.Module) -> List[tuple]:
    return [(name, child) for name, child in module.named_children() if isinstance(child, nn.Linear)]


def is_attention(module: nn.Module) -> bool:
    """A module that says how many heads it has and holds Linears of its own (cut by `attention_cut`, or refused)."""
    return heads_of(module) is not None and bool(_linears(module))


def attentions(module: nn.Module) -> List[str]:
    return [name for name, sub in module.named_modules() if is_attention(sub)]


def default_cuts(module: nn.Module) -> Dict[str, str]:
    """`run.model`'s cuts when the user names none: every pair `linear_pairs` finds and every attention (by "heads");
    refused in one line naming the module where there is neither."""
    cuts = {**linear_pairs(module), **{name: "heads" for name in attentions(module)}}
    if not cuts:
        raise NothingToCut(f"run.model: {type(module).__name__} has no Linear → element-wise → Linear pair in an "
                           "nn.Sequential and no attention (a module with n_head / num_heads and its own q, k, v and "
                           "output Linears) to cut (neuralnet.partition_dim 1): name the pairs in torch's form, or use "
                           "partition_dim 0 (the batch)")
    return cuts


@dataclass(frozen=True)
class AttentionCut:
    """An attention cut by heads: its Linears' styles by qualified name ("qkv": one Linear packing q, k and v, each
    cut column-wise), the features of its input, and its attributes' values on each process."""
    name: str
    linears: Dict[str, str]
    inputs: int
    local: Dict[str, int]


def _where(name: str, module: nn.Module) -> str:
    return f"attention {name!r} ({type(module).__name__})" if name else f"attention {type(module).__name__}"


def attention_cut(name: str, module: nn.Module, nprocs: int) -> AttentionCut:
    """How attention `name` is cut by heads over `nprocs` processes; refused in one line naming it where its heads do
    not divide over them or its Linears are not q, k, v (or one packing them) and an output projection."""
    where = _where(name, module)
    if isinstance(module, nn.MultiheadAttention):
        raise NothingToCut(f"run.model: {where}: torch's nn.MultiheadAttention packs q, k and v in one Parameter and "
                           "checks its embed_dim against its input's width, so it cannot be cut by heads: build it of "
                           "Linears (q, k, v, output), or name the cuts (cuts=) to leave it whole")
    heads = heads_of(module)
    linears = _linears(module)
    shape = (f"{where}: shoal cuts an attention whose own Linears are q, k and v (three, or one packing them) and then "
             f"its output projection, in that order; it has {len(linears)} Linear(s) "
             f"({', '.join(f'{n} {c.in_features}→{c.out_features}' for n, c in linears)})")
    leave = ": name the cuts (cuts=) to leave it whole"
    if heads is None or len(linears) not in (2, 4):
        raise NothingToCut(f"run.model: {shape}{leave}")
    out_name, out = linears[-1]
    width = out.in_features  # the heads' width, all heads side by side
    if width % heads:
        raise NothingToCut(f"run.model: {where}: its output projection takes {width} features, not a multiple of its "
                           f"{heads} heads{leave}")
    prefix = f"{name}." if name else ""
    kv_heads = next((value for value in map(lambda a: _int(module, a), KV_HEADS) if value is not None), heads)
    if len(linears) == 2:
        (qkv_name, qkv), = linears[:1]
        if qkv.out_features != 3 * width:
            raise NothingToCut(f"run.model: {shape}: {qkv_name} gives {qkv.out_features} features, not 3 × the "
                               f"{width} its output projection takes (q, k and v packed){leave}")
        if kv_heads != heads:
            raise NothingToCut(f"run.model: {where}: its {kv_heads} key/value heads of its {heads} are packed with its "
                               f"queries in {qkv_name}, whose split shoal cannot know{leave}")
        styles = {prefix + qkv_name: "qkv"}
        inputs = qkv.in_features
    else:
        (q_name, q), (k_name, k), (v_name, v) = linears[:3]
        head_width = width // heads
        if q.out_features != width or k.out_features != v.out_features or k.out_features != kv_heads * head_width \
                or not q.in_features == k.in_features == v.in_features:
            raise NothingToCut(f"run.model: {shape}: q {q_name} gives {q.out_features} features, k {k_name} "
                               f"{k.out_features} and v {v_name} {v.out_features}, for {heads} heads ({kv_heads} of "
                               f"keys and values) of {head_width}{leave}")
        styles = {prefix + q_name: "colwise", prefix + k_name: "colwise", prefix + v_name: "colwise"}
        inputs = q.in_features
    if heads % nprocs or kv_heads % nprocs:
        what = f"{heads} heads" if heads % nprocs else f"{kv_heads} key/value heads"
        raise NothingToCut(f"run.model: {where}: its {what} do not divide over the group's {nprocs} processes (each "
                           f"process computes whole heads): give it a multiple of {nprocs} heads, or name the cuts "
                           "(cuts=) to leave it whole")
    styles[prefix + out_name] = "rowwise"
    local = {attr: heads // nprocs for attr in HEADS if _int(module, attr) == heads}
    local |= {attr: kv_heads // nprocs for attr in KV_HEADS if _int(module, attr) == kv_heads}
    local |= {attr: width // nprocs for attr in WIDTHS if _int(module, attr) == width}
    return AttentionCut(name, styles, inputs, local)


STYLES = ("colwise", "rowwise")


def checked_cuts(module: nn.Module, cuts) -> Dict[str, str]:
    """The user's `cuts=` (torch's plan: a Linear's qualified name -> "colwise" or "rowwise"; an attention's -> "heads"),
    refused in one line naming the entry that is not a Linear (an attention) of `module`, not a style torch cuts it
    with, or a Linear of an attention (cut together, by heads)."""
    if not isinstance(cuts, dict) or not cuts:
        raise NothingToCut(f"run.model: cuts= is a dict of Linear names to 'colwise' or 'rowwise' (of an attention's "
                           f"name to 'heads'), got {cuts!r}")
    modules = dict(module.named_modules())
    for name, style in cuts.items():
        if style == "heads":
            if name not in modules or not is_attention(modules[name]):
                heads_attrs = " / ".join(HEADS[:3])
                what = "no submodule" if name not in modules else \
                    f"a {type(modules[name]).__name__} without heads (an int {heads_attrs} and Linears of its own)"
                raise NothingToCut(f"run.model: cuts={{{name!r}: 'heads'}}: {type(module).__name__} has {what} of that "
                                   "name, not an attention")
            continue
        if not isinstance(modules.get(name), nn.Linear):
            what = "no submodule" if name not in modules else f"a {type(modules[name]).__name__}"
            raise NothingToCut(f"run.model: cuts={{{name!r}: ...}}: {type(module).__name__} has {what} of that name, not an "
                               "nn.Linear (torch's tensor parallelism cuts Linears)")
        if style not in STYLES:
            raise NothingToCut(f"run.model: cuts={{{name!r}: {style!r}}}: the style is 'colwise' (its output features "
                               "cut) or 'rowwise' (its input features cut, its output summed over the group), or an "
                               "attention's 'heads'")
        parent = name.rpartition(".")[0]
        if is_attention(modules[parent]):
            raise NothingToCut(f"run.model: cuts={{{name!r}: {style!r}}}: it is a Linear of "
                               f"{_where(parent, modules[parent])}, whose forward splits by its heads: cut the attention "
                               f"by them, cuts={{{parent!r}: 'heads'}}")
    return dict(cuts)


def _probe(module: nn.Module, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The module's output (its first, when it gives several) for a fixed input of `width` features, in eval mode
    without gradients, drawing from no generator of the loop's."""
    x = torch.randn(PROBE_ROWS, PROBE_TOKENS, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            out = module(x)
    finally:
        for m, mode in modes:
            m.training = mode
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"it gives a {type(out).__name__}, not a tensor")
    return out.detach().clone()


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def cut(module: nn.Module, plan, device: torch.device, cuts: Dict[str, str] | None = None) -> Dict[str, str]:
    """`run.model`'s module, every process of the plan's one group calling it: each Linear of `cuts` (default: of every
    pair `linear_pairs` finds, and every attention) cut over the group's processes, an attention by its heads (its
    attributes then the process's share, its output checked on a probe input), every other param a replicated
    DTensor that its module sees as a plain tensor. Returns the cuts."""
    from shoal.comm import tensor_parallel  # (torch.distributed.tensor: imported by the layouts that cut a module)

    cuts = cuts or default_cuts(module)
    modules = dict(module.named_modules())
    heads = [attention_cut(name, modules[name], plan.nprocs) for name, style in cuts.items() if style == "heads"]
    linears = {name: style for name, style in cuts.items() if style != "heads"}
    references = {}
    for attention in heads:
        sub = modules[attention.name]
        if any(style == "qkv" for style in attention.linears.values()) and not tensor_parallel.PACKS:
            raise NothingToCut(f"run.model: {_where(attention.name, sub)}: its packed q, k and v need torch's "
                               f"_StridedShard (torch {torch.__version__} has none): name the cuts (cuts=) to leave it "
                               "whole")
        weight = next(iter(sub.parameters()))
        try:
            references[attention.name] = _probe(sub, attention.inputs, weight.device, weight.dtype)
        except Exception as error:  # (every process the same: the same module on the same input)
            raise NothingToCut(f"run.model: {_where(attention.name, sub)}: its forward does not run on one input tensor "
                               f"of {attention.inputs} features ({_first_line(error)}), on which shoal checks its cut: "
                               "name the cuts (cuts=) to leave it whole") from None
        linears |= attention.linears
    tensor_parallel.parallelize(module, range(plan.nprocs), linears, device.type)
    for attention in heads:  # the forward sees its process's heads
        sub = modules[attention.name]
        for attr, value in attention.local.items():
            setattr(sub, attr, value)
        whole = references[attention.name]
        try:
            got = _probe(sub, attention.inputs, whole.device, whole.dtype)
            finfo = torch.finfo(got.dtype)
            tolerance = max(1e-3, 8 * finfo.eps) * (float(whole.abs().max()) + finfo.tiny)
            error = f"a {tuple(got.shape)} output, not {tuple(whole.shape)}" if got.shape != whole.shape else \
                None if float((got - whole).abs().max()) <= tolerance else "other values than the whole module"
        except Exception as failed:  # (every process the same)
            error = _first_line(failed)
        if error is not None:
            told = ", ".join(f"{attr} {value}" for attr, value in attention.local.items()) or "none of its attributes"
            raise NothingToCut(f"run.model: {_where(attention.name, sub)}: cut by heads ({told} on each process), its "
                               f"forward gives {error} on a probe input: it must compute from its heads / width "
                               "attributes, not from its input's width, or name the cuts (cuts=) to leave it whole")
    return cuts
