"""Resume a checkpoint on another number of ranks: gather the ZeRO state, re-partition it.

ZeRO-1/2/3 split the fp32 master weights and the AdamW moments by rank. DeepSpeed's own loader refuses
another world size, and its universal-checkpoint converter (ds_to_universal) unpickles every file with
full pickle loading (weights_only off). So qatfactory gathers the state itself, reading DeepSpeed's files through
:func:`checkpoint.safe_torch_load` (``weights_only=True``, memory-mapped), into plain safetensors::

    <ckpt>/gathered/gathered.json             what was gathered: from how many ranks, the ZeRO stage,
                                              names and shapes, optimizer hyperparameters and step, the
                                              LR scheduler state, DeepSpeed's step counters
    <ckpt>/gathered/state-00000.safetensors   flat (1-D) tensors: ``fp32/<param>`` (the masters),
                                              ``<key>/<param>`` per optimizer state (exp_avg, exp_avg_sq),
                                              ``module/<name>`` for buffers and frozen parameters

Rank 0 writes it (atomically, once: a later resume reuses it) the first time a checkpoint is resumed
on another world size; then every rank of the new world reads what it holds: ZeRO-1/2 the whole
parameter (each rank keeps a full 16/32-bit copy; the fp32 fragment and its moments are taken from
it), ZeRO-3 only its own range of each flat tensor. A trainable parameter's module value is its fp32
master cast to the module dtype, which is what DeepSpeed itself writes after every step (checked for
ZeRO-1/2, whose module copy is saved too).

Layouts read (DeepSpeed 0.19, one model-parallel rank):
* ZeRO-1/2: rank r's ``single_partition_of_fp32_groups[g]`` and base-optimizer state hold, for each
  parameter of group g, the fragment ``param_slice_mappings[g][name]`` (start, numel); a parameter's
  fragments in rank order are its flattened values.
* ZeRO-3: every parameter is split into ``ceil(numel / world)`` elements per rank (zero padding at the
  end); rank r's ``fp32_flat_groups[i]`` is the concatenation, in ``param_shapes[i]`` order, of its
  piece of each parameter of sub-group i, and the optimizer state i has the same layout.
Anything else (another stage, several model-parallel ranks, offloaded optimizer state) is refused.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .. import _fsutil
from .._inputs import read_json
from ..exitcodes import BadInputError, CorruptFileError
from . import ckpt_files as C

GATHERED = "gathered"
INDEX = "gathered.json"
FORMAT = 1
SHARD_BYTES = 1 << 30


def _say(msg: str) -> None:
    print(f"[qatfactory] {msg}", file=sys.stderr, flush=True)


def _numel(shape) -> int:
    return int(math.prod(int(x) for x in shape))


def _plain(v):
    """JSON form of optimizer / scheduler state (tuples -> lists); refuses tensors and objects."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    raise BadInputError(f"reshard: cannot carry a {type(v).__name__} of the optimizer / scheduler state")


# ----------------------------------------------------------------------------- writing
class _Shards:
    """Flat tensors into state-NNNNN.safetensors files of about ``limit`` bytes each."""

    def __init__(self, root: Path, limit: int):
        self.root, self.limit = root, limit
        self.cur: Dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: Dict[str, str] = {}
        self.n = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if key in self.files or key in self.cur:
            raise CorruptFileError(f"reshard: {key} gathered twice")
        t = t.detach().reshape(-1).contiguous().clone()
        self.cur[key] = t
        self.size += t.numel() * t.element_size()
        if self.size >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.cur:
            return
        name = f"state-{self.n:05d}.safetensors"
        save_file(self.cur, str(self.root / name), metadata={"producer": "qatfactory", "what": "gathered"})
        for k in self.cur:
            self.files[k] = name
        self.cur, self.size = {}, 0
        self.n += 1


def _optim_file(ds: Path, r: int) -> Path:
    """Rank r's optimizer partition: zero_pp_rank_R_..., or bf16_zero_pp_rank_R_... under bf16."""
    found = sorted(ds.glob(f"*zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
    if len(found) != 1:
        raise CorruptFileError(f"{ds}: {len(found)} optimizer state files of rank {r} (want one)")
    return found[0]


def _cat_fragments(name: str, numel: int, pieces: List[torch.Tensor], where: str) -> torch.Tensor:
    got = sum(p.numel() for p in pieces)
    if got != numel:
        raise CorruptFileError(f"{where}: the fragments of {name} hold {got} values, its shape {numel}")
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _zero12(ds: Path, world: int, out: _Shards, idx: Dict[str, Any]) -> None:
    model = C.safe_torch_load(ds / "mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
    osd = [C.safe_torch_load(_optim_file(ds, r), map_location="cpu", mmap=True)["optimizer_state_dict"]
           for r in range(world)]
    where = str(ds)
    for r, o in enumerate(osd):
        if [int(x) for x in o.get("partition_count", [])] != [world] * len(model["param_shapes"]):
            raise CorruptFileError(f"{where}: rank {r}'s optimizer state is partitioned "
                                   f"{o.get('partition_count')} ways, the checkpoint says {world} ranks")
    shared = set((model.get("shared_params") or {}).keys())
    module = model["module"]
    steps, keys_all = [], None
    for g, shapes in enumerate(model["param_shapes"]):
        fp32 = [o["single_partition_of_fp32_groups"][g] for o in osd]
        states = [o["base_optimizer_state"]["state"][g] for o in osd]
        keys = sorted(k for k, v in states[0].items() if torch.is_tensor(v) and tuple(v.shape) == tuple(fp32[0].shape))
        keys_all = keys if keys_all is None else keys_all
        if keys != keys_all:
            raise CorruptFileError(f"{where}: optimizer groups hold different states ({keys_all} / {keys})")
        steps += [s.get("step") for s in states]
        for name, shape in shapes.items():
            n = _numel(shape)
            frags = [(r, o["param_slice_mappings"][g].get(name)) for r, o in enumerate(osd)]
            frags = [(r, f) for r, f in frags if f is not None and int(f.numel) > 0]
            for kind, flats in [("fp32", fp32)] + [(k, [s[k] for s in states]) for k in keys]:
                full = _cat_fragments(name, n, [flats[r].narrow(0, int(f.start), int(f.numel)) for r, f in frags],
                                      where)
                if kind == "fp32":
                    lp = module.get(name)
                    if lp is None or not torch.equal(lp.reshape(-1), full.to(lp.dtype)):
                        raise CorruptFileError(f"{where}: the module's {name} is not its fp32 master cast to "
                                               f"{getattr(lp, 'dtype', None)}; the checkpoint is inconsistent")
                    idx["trainable"][name] = {"shape": list(shape), "dtype": str(lp.dtype).replace("torch.", "")}
                out.add(f"{kind}/{name}", full)
    for name, t in module.items():
        if name in idx["trainable"] or name in shared:
            continue
        kind = "buffers" if name in set(model.get("buffer_names") or []) else "frozen"
        idx[kind][name] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        out.add(f"module/{name}", t)
    idx["opt_keys"] = keys_all or []
    _common(idx, model, [o["base_optimizer_state"]["param_groups"] for o in osd], steps, where)


def _zero3(ds: Path, world: int, out: _Shards, idx: Dict[str, Any]) -> None:
    models = [C.safe_torch_load(ds / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", map_location="cpu", mmap=True)
              for r in range(world)]
    osd = [C.safe_torch_load(_optim_file(ds, r), map_location="cpu", mmap=True)["optimizer_state_dict"]
           for r in range(world)]
    where = str(ds)
    for r, o in enumerate(osd):
        if int(o.get("partition_count", -1)) != world:
            raise CorruptFileError(f"{where}: rank {r}'s optimizer state is partitioned "
                                   f"{o.get('partition_count')} ways, the checkpoint says {world} ranks")
    m0 = models[0]
    shared = set((m0.get("shared_params") or {}).keys())
    steps, keys_all = [], None
    for i, shapes in enumerate(m0["param_shapes"]):
        fp32 = [o["fp32_flat_groups"][i] for o in osd]
        states = [o["optimizer_state_dict"]["state"][i] for o in osd]
        keys = sorted(k for k, v in states[0].items() if torch.is_tensor(v) and tuple(v.shape) == tuple(fp32[0].shape))
        keys_all = keys if keys_all is None else keys_all
        if keys != keys_all:
            raise CorruptFileError(f"{where}: optimizer sub-groups hold different states ({keys_all} / {keys})")
        steps += [s.get("step") for s in states]
        off = 0
        for name, shape in shapes.items():
            n = _numel(shape)
            part = math.ceil(n / world)
            if off + part > fp32[0].numel():
                raise CorruptFileError(f"{where}: sub-group {i} ends before its parameter {name}")
            for kind, flats in [("fp32", fp32)] + [(k, [s[k] for s in states]) for k in keys]:
                out.add(f"{kind}/{name}", torch.cat([f.narrow(0, off, part) for f in flats])[:n])
            idx["trainable"][name] = {"shape": list(shape), "dtype": "float32"}
            off += part
        if off != fp32[0].numel():
            raise CorruptFileError(f"{where}: sub-group {i} holds {fp32[0].numel()} values per rank, its parameters "
                                   f"{off}; not a ZeRO-3 layout qatfactory reads")
    for name, shape in (m0.get("frozen_param_shapes") or {}).items():
        n = _numel(shape)
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        full = torch.cat(pieces)[:n]
        if full.numel() != n:
            raise CorruptFileError(f"{where}: the fragments of frozen {name} hold {full.numel()} values, not {n}")
        idx["frozen"][name] = {"shape": list(shape), "dtype": str(full.dtype).replace("torch.", "")}
        out.add(f"module/{name}", full)
    buffers = set(m0.get("buffer_names") or [])
    for name, t in m0["module"].items():
        if name in buffers and name not in shared:
            idx["buffers"][name] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            out.add(f"module/{name}", t)
    idx["opt_keys"] = keys_all or []
    _common(idx, m0, [o["optimizer_state_dict"]["param_groups"] for o in osd], steps, where)


def _common(idx, model, groups_per_rank, steps, where) -> None:
    vals = {float(s.item() if torch.is_tensor(s) else s) for s in steps if s is not None}
    if len(vals) > 1:
        raise CorruptFileError(f"{where}: the optimizer's step differs between groups / ranks: {sorted(vals)}")
    idx["opt_step"] = vals.pop() if vals else None
    idx["opt_step_tensor"] = any(torch.is_tensor(s) for s in steps)
    idx["param_groups"] = [_plain({k: v for k, v in g.items() if k != "params"}) for g in groups_per_rank[0]]
    idx["lr_scheduler"] = _plain(model.get("lr_scheduler")) if model.get("lr_scheduler") is not None else None
    for k in ("global_steps", "global_samples", "skipped_steps"):
        idx[k] = _plain(model.get(k))
    if int(model.get("mp_world_size", 1) or 1) != 1:
        raise BadInputError(f"{where}: model-parallel checkpoints (mp_world_size={model.get('mp_world_size')}) "
                            f"are not resharded")


def gather(ckpt, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write ``<ckpt>/gathered/`` from a ZeRO-1/2/3 checkpoint (one process; rank 0 at a resume).
    Reused when it is already there and complete."""
    ckpt = Path(ckpt)
    out = ckpt / GATHERED
    st = C.read_state(ckpt)
    if out.is_symlink() or (out / INDEX).is_symlink():
        _fsutil.own_file(ckpt, GATHERED, "the gathered state")
        _fsutil.own_file(out, INDEX, "the gathered index")
    if (out / INDEX).is_file():
        read_index(out, st)
        return out
    why = C.incomplete(ckpt)
    if why is not None:
        raise CorruptFileError(f"checkpoint {ckpt} is incomplete: {why}")
    C.scan(ckpt)
    world = int(st.get("world_size", 1))
    zero = int(((st.get("config") or {}).get("train") or {}).get("zero_stage", 0) or 0)
    ds = ckpt / C.DS_TAG
    idx: Dict[str, Any] = {"qatfactory_gathered": FORMAT, "step": st["step"], "from_world": world,
                           "zero_stage": zero, "trainable": {}, "frozen": {}, "buffers": {}}
    with _fsutil.atomic_dir(out, kinds=(), what="reshard") as tmp:
        shards = _Shards(Path(tmp), shard_bytes)
        if zero in (1, 2):
            _zero12(ds, world, shards, idx)
        elif zero == 3:
            _zero3(ds, world, shards, idx)
        else:
            raise BadInputError(f"reshard: {ckpt} is a ZeRO-{zero} checkpoint; its optimizer state is not "
                                f"partitioned (DeepSpeed loads it on any number of ranks)")
        shards.flush()
        idx["files"] = shards.files
        _fsutil.write_text_atomic(Path(tmp) / INDEX, json.dumps(idx, indent=1))
    _say(f"gathered {ckpt.name} (ZeRO-{zero}, {world} rank(s), {len(idx['trainable'])} trainable tensors) into {out}")
    return out


def read_index(gdir, st: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    p = _fsutil.own_file(gdir, INDEX, "the gathered index")
    try:
        idx = read_json(p)
    except CorruptFileError:
        raise
    except (OSError, ValueError) as e:
        raise CorruptFileError(f"{p}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(idx, dict) or idx.get("qatfactory_gathered") != FORMAT or not isinstance(idx.get("files"), dict):
        raise CorruptFileError(f"{p}: not a qatfactory gathered checkpoint (format {FORMAT})")
    if st is not None and (idx.get("step") != st["step"] or idx.get("from_world") != st.get("world_size", 1)):
        raise CorruptFileError(f"{p}: gathered from step {idx.get('step')} / {idx.get('from_world')} ranks, the "
                               f"checkpoint is step {st['step']} / {st.get('world_size', 1)} ranks")
    for f in set(idx["files"].values()):
        if not re.fullmatch(r"state-\d{5}\.safetensors", str(f)):       # never a path read from a file
            raise CorruptFileError(f"{p}: names a file {f!r} that is not one of ours")
    return idx


# ----------------------------------------------------------------------------- reading on the new world
class _Reader:
    def __init__(self, gdir: Path, idx: Dict[str, Any]):
        self.gdir, self.idx, self.open = gdir, idx, {}
        self._safe_open = safe_open

    def _f(self, key):
        name = self.idx["files"].get(key)
        if name is None:
            raise CorruptFileError(f"{self.gdir}: {key} was not gathered")
        if name not in self.open:
            _fsutil.own_file(self.gdir, name, "a gathered state file")   # never a link to a file elsewhere
            try:
                self.open[name] = self._safe_open(str(self.gdir / name), framework="pt")
            except Exception as e:  # SafetensorError
                raise CorruptFileError(f"{self.gdir / name}: not a readable safetensors file ({e})") from None
        return self.open[name]

    def _sized(self, key: str, n: int):
        sl = self._f(key).get_slice(key)
        if list(sl.get_shape()) != [n]:
            raise CorruptFileError(f"{self.gdir / self.idx['files'][key]}: {key} holds {sl.get_shape()} values, "
                                   f"{self.gdir / INDEX} says [{n}]")
        return sl

    def full(self, key: str, n: int) -> torch.Tensor:
        return self._sized(key, n)[:]

    def range(self, key: str, n: int, a: int, b: int) -> torch.Tensor:
        return self._sized(key, n)[a:b]


def _persistent_buffers(module) -> Iterator[Tuple[str, torch.Tensor]]:
    for mn, m in module.named_modules():
        for bn, b in m.named_buffers(recurse=False):
            if b is not None and bn not in m._non_persistent_buffers_set:
                yield (f"{mn}.{bn}" if mn else bn), b


def _base_optimizer(opt):
    base = getattr(opt, "optimizer", None)
    if not isinstance(base, torch.optim.Optimizer):
        raise BadInputError(f"reshard: the engine's optimizer {type(opt).__name__} does not wrap a torch optimizer")
    return base


def _local(r: _Reader, key: str, n: int, rank: int, world: int) -> torch.Tensor:
    """This rank's ZeRO-3 piece of a flat tensor of n values: ceil(n / world) values, zero padded."""
    part = math.ceil(n / world)
    a, b = min(n, rank * part), min(n, (rank + 1) * part)
    t = r.range(key, n, a, b)
    if t.numel() < part:
        t = torch.cat([t, torch.zeros(part - t.numel(), dtype=t.dtype)])
    return t


def load(engine, gdir, rank: int, world: int) -> Dict[str, Any]:
    """Put a gathered checkpoint into a freshly initialized ZeRO-1/2/3 engine of ``world`` ranks:
    module weights and buffers, fp32 masters, optimizer state and hyperparameters, LR scheduler and
    DeepSpeed's step counters. Returns the index."""
    gdir = Path(gdir)
    idx = read_index(gdir)
    zero = int(engine.zero_optimization_stage())
    if zero != idx["zero_stage"]:
        raise BadInputError(f"reshard: gathered from ZeRO-{idx['zero_stage']}, the engine runs ZeRO-{zero}")
    if zero not in (1, 2, 3):
        raise BadInputError(f"reshard: the engine runs ZeRO-{zero}; only ZeRO-1/2/3 state is re-partitioned")
    module, opt = engine.module, engine.optimizer
    base = _base_optimizer(opt)
    params = dict(module.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    buffers = dict(_persistent_buffers(module))
    for what, have, want in (("trainable parameters", trainable, idx["trainable"]),
                             ("frozen parameters", frozen, idx["frozen"]), ("buffers", buffers, idx["buffers"])):
        if set(have) != set(want):
            a, b = sorted(set(want) - set(have)), sorted(set(have) - set(want))
            raise BadInputError(f"reshard: {gdir} does not fit this model's {what}: only in the checkpoint {a[:4]}, "
                                f"only in the model {b[:4]}")
        for n, t in have.items():
            shape = list(getattr(t, "ds_shape", t.shape)) if zero == 3 else list(t.shape)
            if shape != list(want[n]["shape"]):
                raise BadInputError(f"reshard: {n} is {shape} in the model, {want[n]['shape']} in {gdir}")
    keys = list(idx["opt_keys"])
    # the optimizer's state is created lazily at its first step: create it, then fill it
    # ZeRO-3 hands its flat fp32 partitions to the optimizer only for the length of a step
    flats = list(opt.fp32_partitioned_groups_flat) if zero == 3 else [f for g in base.param_groups for f in g["params"]]
    for f in flats:
        s = base.state[f]
        s.clear()
        if idx["opt_step"] is not None:
            s["step"] = torch.tensor(float(idx["opt_step"]), dtype=torch.float32) if idx["opt_step_tensor"] \
                else int(idx["opt_step"])
        for k in keys:
            s[k] = torch.zeros_like(f)
    if zero in (1, 2):
        link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
        if link is None:
            raise BadInputError("reshard: this DeepSpeed's ZeRO-1/2 optimizer has no _lazy_init_hp_params_optimizer_state")
        opt._hp_optimizer_states_linked = False
        link()
    from deepspeed.utils import (  # noqa: PLC0415 (optional: deepspeed)
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )
    r = _Reader(gdir, idx)
    with torch.no_grad():
        for n, p in trainable.items():
            shape = idx["trainable"][n]["shape"]
            if zero == 3:
                num = _numel(shape)
                v = _local(r, f"fp32/{n}", num, rank, world)
                safe_set_local_fp32_param(p, v)
                for k in keys:
                    safe_set_local_optimizer_state(p, _local(r, f"{k}/{n}", num, rank, world), k)
                p.ds_tensor.data.copy_(v.to(p.ds_tensor.dtype).reshape(p.ds_tensor.shape))
            else:
                num = _numel(shape)
                v = r.full(f"fp32/{n}", num).reshape(shape)
                safe_set_full_fp32_param(p, v)
                for k in keys:
                    safe_set_full_optimizer_state(p, r.full(f"{k}/{n}", num).reshape(shape), k)
                p.data.copy_(v.to(p.dtype))
        for n, p in frozen.items():
            if zero == 3:
                v = _local(r, f"module/{n}", _numel(idx["frozen"][n]["shape"]), rank, world)
                p.ds_tensor.data.copy_(v.to(p.ds_tensor.dtype).reshape(p.ds_tensor.shape))
            else:
                p.data.copy_(r.full(f"module/{n}", p.numel()).reshape(p.shape))
        for n, b in buffers.items():
            b.data.copy_(r.full(f"module/{n}", b.numel()).reshape(b.shape))
    saved = idx["param_groups"]
    if len(saved) != len(base.param_groups) and len({json.dumps(g, sort_keys=True) for g in saved}) != 1:
        raise BadInputError(f"reshard: {len(saved)} optimizer groups in {gdir}, {len(base.param_groups)} in the engine")
    for i, g in enumerate(base.param_groups):
        for k, v in (saved[i] if len(saved) == len(base.param_groups) else saved[0]).items():
            g[k] = tuple(v) if k == "betas" else v
    if engine.lr_scheduler is not None and idx["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(dict(idx["lr_scheduler"]))
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if idx.get(k) is not None:
            setattr(engine, k, idx[k])
    return idx


def prepare(ckpt, rank: int) -> Path:
    """Every rank: rank 0 gathers ``ckpt`` (when not done before), the others wait; an error on
    rank 0 is raised on every rank."""
    out: Any = None
    if rank == 0:
        try:
            out = ("ok", str(gather(ckpt)))
        except Exception as e:  # noqa: BLE001 - handed to every rank, then raised
            out = ("err", e)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [out]
        torch.distributed.broadcast_object_list(box, src=0)
        out = box[0]
    if out[0] == "err":
        raise out[1]
    return Path(out[1])
