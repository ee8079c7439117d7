"""A ZeRO-3 student gathered one layer at a time into a CPU copy on rank 0, for the export.

Gathering every parameter at once (``GatheredParameters(all)``) puts the whole model on every GPU next
to the optimizer state, which is what ZeRO-3 was there to avoid. Here the parameters are gathered in
units: each child of a ``ModuleList`` (a decoder layer, with its fused q/k/v and gate/up peers and its
experts) and then every other parameter alone (embedding, final norm, an untied head). All ranks join
each gather; rank 0 copies the unit's full values to the CPU, the gather is released, the next unit
follows. No GPU holds more than one unit beyond its own partition; rank 0's host memory holds the
whole student in its dtype, which is what the exporters read.

Rank 0 then rebuilds the student on the CPU the way ``quantize.load_student`` does (the model class
from its config, ``prepare`` with the same QuantConfig, the gathered state loaded into it), so
``save_student``, ``convert``, the exporter and the gate run unchanged on that copy. Every parameter
and persistent buffer of the copy must come from the gathered state (tied ones through their tie),
else the export stops with the names.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..quantize import prepare


def _units(lm: nn.Module) -> List[Tuple[str, List[Tuple[str, nn.Parameter]]]]:
    """(label, [(name, param)]) in gather order: ModuleList children first, then the rest one by one."""
    names = {id(p): n for n, p in lm.named_parameters()}
    taken = set()
    units = []
    for mn, m in lm.named_modules():
        if not isinstance(m, nn.ModuleList):
            continue
        for cn, child in m.named_children():
            ps = [(names[id(p)], p) for p in child.parameters() if id(p) in names and id(p) not in taken]
            if ps:
                taken.update(id(p) for _, p in ps)
                units.append((f"{mn}.{cn}", ps))
    for n, p in lm.named_parameters():
        if id(p) not in taken:
            taken.add(id(p))
            units.append((n, [(n, p)]))
    return units


def gather_state(lm: nn.Module, rank: int) -> Tuple[Optional[Dict[str, torch.Tensor]], Dict[str, Any]]:
    """Every rank: gather ``lm``'s ZeRO-3 parameters unit by unit. Rank 0 returns (state on the CPU,
    stats); the others (None, stats). ``stats['max_unit_numel']`` is the most elements gathered at once."""
    import deepspeed  # noqa: PLC0415 (optional: deepspeed)
    state: Optional[Dict[str, torch.Tensor]] = {} if rank == 0 else None
    units = _units(lm)
    biggest = 0
    for _, ps in units:
        zparams = [p for _, p in ps if hasattr(p, "ds_id")]
        numel = sum(int(getattr(p, "ds_numel", p.numel())) for _, p in ps)
        biggest = max(biggest, numel)
        with deepspeed.zero.GatheredParameters(zparams, modifier_rank=None):
            if state is not None:
                for n, p in ps:
                    state[n] = p.detach().to("cpu", copy=True)
    if state is not None:
        for mn, m in lm.named_modules():
            for bn, b in m.named_buffers(recurse=False):
                if b is not None and bn not in m._non_persistent_buffers_set:
                    state[f"{mn}.{bn}" if mn else bn] = b.detach().to("cpu", copy=True)
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in lm.parameters())
    return state, {"units": len(units), "max_unit_numel": biggest, "total_numel": total}


def _empty_init():
    try:
        # skips random init: every value is loaded
        from transformers.initialization import no_init_weights  # noqa: PLC0415 (heavy: transformers)
        return no_init_weights()
    except ImportError:
        return contextlib.nullcontext()


def rebuild(lm: nn.Module, state: Dict[str, torch.Tensor]) -> nn.Module:
    """Rank 0: a CPU copy of ``lm`` (same class and config, prepared with its QuantConfig when it has
    one) holding ``state``."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 (heavy: transformers)
    dtype = next(iter(lm.parameters())).dtype          # what save_student records and load_student builds
    with _empty_init():
        copy = AutoModelForCausalLM.from_config(lm.config, dtype=dtype, trust_remote_code=False)
    if hasattr(copy, "tie_weights"):
        copy.tie_weights()                  # the skipped init also skipped the tie of a tied head
    # the plain weights first, so prepare() initialises its scale state from the trained weights
    # (as the run's own prepare did from its weights) and never from uninitialised memory
    _load(copy, state, complete=False)
    qcfg = getattr(lm, "_qf_config", None)
    if qcfg is not None:
        prepare(copy, qcfg)
    _load(copy, state, complete=True)
    return copy.eval()


def _load(copy: nn.Module, state: Dict[str, torch.Tensor], complete: bool) -> None:
    names = dict(copy.named_parameters(remove_duplicate=False))
    for mn, m in copy.named_modules():
        for bn, b in m.named_buffers(recurse=False):
            if b is not None and bn not in m._non_persistent_buffers_set:
                names[f"{mn}.{bn}" if mn else bn] = b
    if complete:
        unexpected = sorted(set(state) - set(names))
        if unexpected:
            raise RuntimeError(f"stream export: gathered tensors the rebuilt student does not have: {unexpected[:6]}")
    loaded = set()
    with torch.no_grad():
        for n, t in names.items():
            if n in state:
                if tuple(t.shape) != tuple(state[n].shape):
                    raise RuntimeError(f"stream export: {n} is {tuple(state[n].shape)} gathered, {tuple(t.shape)} "
                                       f"in the rebuilt student")
                t.copy_(state[n])
                loaded.add(id(t))
    missing = sorted(n for n, t in names.items() if id(t) not in loaded)
    if complete and missing:
        raise RuntimeError(f"stream export: the rebuilt student has tensors nothing was gathered into: {missing[:6]}")


def cpu_student(lm: nn.Module, rank: int) -> Tuple[Optional[nn.Module], Dict[str, Any]]:
    """Every rank joins; rank 0 gets the CPU copy of the ZeRO-3 student (others None) and the stats."""
    state, stats = gather_state(lm, rank)
    return (rebuild(lm, state) if state is not None else None), stats
