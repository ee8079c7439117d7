"""qatfactory/native.py + exporters/verify/code_plane.py: native NVFP4/MXFP4 checkpoints load as frozen codes +
scale bytes and, at theta = 0, compute the exported student's logits bit for bit (ModelOpt, compressed-tensors,
GGUF); trained scale bytes merge into an export whose code plane is the base's byte for byte and whose logits
are the training forward's (the gate + its code-plane hook PASS, same container and across containers); a
scale file swaps in memory, patches the base file (only scale bytes change) and rolls back; bad input gets a
one-line error (not a native layout, W4A4, a format mismatch, a code plane that changed, a path outside)."""
import json
import shutil

import numpy as np
import pytest
import torch

from test_exporters_helpers import student

from qatfactory import native as N
from qatfactory.exitcodes import BAD_INPUT, BadInputError
from qatfactory.exporters import export, verify
from qatfactory.exporters.verify.code_plane import check_code_plane, check_training_logits
from qatfactory.exporters.verify.common import default_prompt, model_from_state_dict, student_weights

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
BASES = {  # name -> (student format, engine, flavour)
    "modelopt": ("nvfp4", "vllm", "modelopt"),
    "ct_nvfp4": ("nvfp4", "vllm", "compressed-tensors"),
    "ct_mxfp4": ("mxfp4", "vllm", "compressed-tensors"),
    "gguf_nvfp4": ("nvfp4", "llama_cpp", None),
    "gguf_mxfp4": ("mxfp4_ggml", "llama_cpp", None),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    out = {}
    for k, (fmt, eng, fl) in BASES.items():
        export(student("llama", fmt), root / k, engine=eng, flavour=fl)
        out[k] = root / k
    return out


def _ref_weights(cm, container):
    """The student's weights as the engine decodes the base: compressed-tensors NVFP4 stores G = 1/S and vLLM
    multiplies by fl(1/G) (written out here from the E2M1 table and the fp8 bytes, not through qatfactory)."""
    sd = student_weights(cm)
    if container != "ct_nvfp4":
        return sd
    for name, p in cm.packed.items():
        S2 = torch.ones(()) / (torch.ones(()) / p.global_scale.float())
        vals = _E2M1[torch.stack([p.codes & 15, p.codes >> 4], -1).reshape(p.shape[0], -1).long()]
        s = p.scales.view(torch.float8_e4m3fn).float() * S2
        sd[name] = (vals.reshape(p.shape[0], -1, 16) * s[..., None]).reshape(p.shape)
    return sd


@pytest.mark.parametrize("kind", list(BASES))
def test_theta_zero_is_the_base_bit_for_bit(bases, kind):
    fmt = BASES[kind][0]
    cm = student("llama", fmt)
    ck = N.read_native(bases[kind])
    assert ck.container == ("gguf" if kind.startswith("gguf") else BASES[kind][2])
    assert set(ck.packed) == set(cm.packed) and N.resolve_target(ck) == fmt
    for n, p in cm.packed.items():                       # codes as the student packed them, every container
        assert torch.equal(ck.packed[n].codes, p.codes) and torch.equal(ck.packed[n].scales, p.scales & 0x7F
                                                                         if fmt == "nvfp4" else p.scales)
    model = N.build_model(ck)
    ids = torch.tensor([default_prompt(cm.config["vocab_size"])])
    ref = model_from_state_dict(cm.config, _ref_weights(cm, kind))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(".theta") for n in trainable)
    assert all(b.dtype == torch.uint8 for n, b in model.named_buffers() if n.endswith((".codes", ".scales0")))


@pytest.mark.parametrize("base,engine,flavour", [("ct_nvfp4", "vllm", "compressed-tensors"),
                                                 ("modelopt", "llama_cpp", None),
                                                 ("gguf_mxfp4", "llama_cpp", None)])
def test_merged_export_keeps_the_code_plane_and_the_training_logits(bases, tmp_path, base, engine, flavour):
    ck = N.read_native(bases[base])
    model = N.build_model(ck)
    torch.manual_seed(0)
    for m in N.adapter_modules(model).values():
        m.theta.data.normal_(0, 0.3 if ck.layout == "nvfp4" else 1.0)
    cm = N.merged_converted(model, ck)
    assert any(not torch.equal(cm.packed[n].scales, p.scales) for n, p in ck.packed.items())
    out = tmp_path / "merged"
    export(cm, out, engine=engine, flavour=flavour)
    res = verify(out, cm)
    sha = check_code_plane(res, out, bases[base], cm)
    prompt = default_prompt(cm.config["vocab_size"])
    with torch.no_grad():
        lg = model(torch.tensor([prompt])).logits[0]
    check_training_logits(res, cm, lg, prompt)
    assert res.verdict == "PASS", res.table()
    assert sha["export"] == sha["base"] == ck.code_plane_sha256()        # the gate's reader == the loader's
    rows = {(c.tensor, c.check): c for c in res.checks}
    assert rows[("code plane", "codes == base export")].status == "ok"
    assert rows[("logits", "training forward == merged student")].status == "ok"


def test_code_plane_hook_catches_a_changed_code_and_a_changed_dense_tensor(bases, tmp_path):
    ck = N.read_native(bases["ct_mxfp4"])
    cm = N.converted_with_scales(ck, {n: p.scales for n, p in ck.packed.items()})
    n0 = sorted(cm.packed)[0]
    cm.packed[n0].codes[0, 0] ^= 0x01                   # one E2M1 code of one element
    e = "model.norm.weight"
    cm.dense[e] = cm.dense[e].clone()
    cm.dense[e][0] += 1
    out = tmp_path / "tampered"
    export(cm, out, engine="vllm", flavour="compressed-tensors")
    res = verify(out, cm)                                # the export is what this student says...
    check_code_plane(res, out, bases["ct_mxfp4"], cm)    # ...but not the base's code plane
    rows = {(c.tensor, c.check): c for c in res.checks}
    assert rows[("code plane", "codes == base export")].status == "FAIL"
    assert n0 in rows[("code plane", "codes == base export")].detail
    assert rows[("code plane", "dense tensors == base")].status == "FAIL" and e in rows[
        ("code plane", "dense tensors == base")].detail
    assert res.verdict == "FAIL"


@pytest.mark.parametrize("base", ["ct_nvfp4", "gguf_nvfp4"])
def test_scale_file_swap_patch_and_rollback(bases, tmp_path, base):
    ck = N.read_native(bases[base])
    model = N.build_model(ck)
    ids = torch.tensor([default_prompt(ck.config["vocab_size"])])
    with torch.no_grad():
        y_base = model(ids).logits
        for m in N.adapter_modules(model).values():
            m.theta.normal_(0, 0.3)
        y_task = model(ids).logits
    f = tmp_path / "task.scales.safetensors"
    meta = N.save_scale_file(model, ck, f, task="t")
    assert meta["base_code_plane_sha256"] == ck.code_plane_sha256()
    size = f.stat().st_size
    assert size < 0.15 * ck.nbytes()["total"]
    # in memory: a fresh base model takes the file and computes the task's logits exactly
    other = N.build_model(ck)
    N.apply_scales(other, ck, f)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, y_task)
    # on disk: only the scale bytes of the base file change
    out = tmp_path / "patched"
    r = N.write_patched(bases[base], f, out)
    assert r["scale_bytes_changed"] > 0
    ck2 = N.read_native(out)
    assert ck2.code_plane_sha256() == ck.code_plane_sha256()
    for n, p in ck.packed.items():
        assert torch.equal(ck2.packed[n].codes, p.codes)
        assert torch.equal(ck2.packed[n].global_scale.view(torch.int32), p.global_scale.view(torch.int32))
    assert all(torch.equal(ck2.dense[k].view(torch.uint8) if ck2.dense[k].ndim else ck2.dense[k], v.view(torch.uint8)
                           if v.ndim else v) for k, v in ck.dense.items())
    with torch.no_grad():
        assert torch.equal(N.build_model(ck2)(ids).logits, y_task)
    if base.startswith("gguf"):                          # every byte of the file outside the scale bytes is the base's
        a = np.fromfile(bases[base] / "model.gguf", np.uint8)
        b = np.fromfile(out / "model.gguf", np.uint8)
        assert a.shape == b.shape and 0 < int((a != b).sum()) <= sum(int(p.scales.numel()) for p in ck.packed.values())
    # the patched directory passes the gate as the merged student (it is a qatfactory export)
    res = verify(out, N.converted_with_scales(ck, N.load_scale_file(f, ck)[0]))
    assert res.verdict == "PASS", res.table()
    # rollback: the base's own scales
    rb = tmp_path / "base.scales.safetensors"
    N.base_scale_file(ck, rb)
    N.apply_scales(other, ck, rb)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, y_base)
    # a scale file applies only onto its own code plane
    ck_other = N.read_native(bases["modelopt" if base == "ct_nvfp4" else "ct_nvfp4"])
    ck_other.packed[sorted(ck_other.packed)[0]].codes[0, 0] ^= 0x10
    with pytest.raises(N.CodePlaneError, match="code plane"):
        N.apply_scales(other, ck_other, f)


def test_bad_input_is_refused_with_one_line(bases, tmp_path):
    def refused(path, match, **kw):
        with pytest.raises(BadInputError, match=match) as e:
            N.build_model(N.read_native(path), **kw)
        assert e.value.exit_code == BAD_INPUT and "\n" not in str(e.value)

    # a high-precision HF directory
    hp = tmp_path / "hf"
    model_from_state_dict(student("llama", "nvfp4").config, student_weights(student("llama", "nvfp4"))) \
        .save_pretrained(hp)
    refused(hp, "no quantization_config")
    # W4A4 (activation-quantized) checkpoints
    w4a4 = tmp_path / "w4a4"
    export(student("llama", "nvfp4", act="nvfp4_act"), w4a4, engine="vllm", flavour="compressed-tensors")
    refused(w4a4, "W4A4")
    # a target whose bytes differ from the base's layout
    refused(bases["ct_nvfp4"], "format mismatch", target="mxfp4")
    refused(bases["gguf_mxfp4"], "format mismatch", target="nvfp4")
    # a shard index that points outside the directory
    evil = tmp_path / "evil"
    shutil.copytree(bases["modelopt"], evil)
    (evil / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (evil / N.INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "../outside.safetensors"}}))
    refused(evil, "not a plain file name")
    # a GGUF with another quant type
    q4k = tmp_path / "q4k"
    export(student("llama", "q4_k"), q4k, engine="llama_cpp")
    refused(q4k, "Q4_K")


def test_cli_scales_export_apply_and_rollback(bases, tmp_path, capsys):
    from qatfactory.faces.cli import main
    ck = N.read_native(bases["ct_mxfp4"])
    model = N.build_model(ck)
    torch.manual_seed(1)
    for m in N.adapter_modules(model).values():
        m.theta.data.normal_(0, 1.0)
    f = tmp_path / "t.scales.safetensors"
    N.save_scale_file(model, ck, f)
    assert main(["scales", "export", "--base", str(bases["ct_mxfp4"]), "--scales", str(f), "--engine", "llama_cpp",
                 "--out", str(tmp_path / "gguf"), "--quiet"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    assert main(["scales", "apply", "--base", str(bases["ct_mxfp4"]), "--scales", str(f), "--out",
                 str(tmp_path / "task"), "--quiet"]) == 0
    assert main(["scales", "extract", str(bases["ct_mxfp4"]), "--out", str(tmp_path / "base.scales.safetensors")]) == 0
    assert main(["scales", "apply", "--base", str(tmp_path / "task"), "--scales", str(tmp_path / "base.scales.safetensors"),
                 "--out", str(tmp_path / "rolled"), "--quiet"]) == 0
    # the rollback is the base file byte for byte (safetensors writes the same header and tensors)
    assert (tmp_path / "rolled" / "model.safetensors").read_bytes() == (bases["ct_mxfp4"] / "model.safetensors").read_bytes()
    capsys.readouterr()
    # a scale file onto another code plane: one line, BAD_INPUT, nothing written
    assert main(["scales", "apply", "--base", str(bases["ct_nvfp4"]), "--scales", str(f), "--out",
                 str(tmp_path / "no")]) == BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "code plane" in err[0] and not (tmp_path / "no").exists()


def test_scales_extract_never_overwrites_a_file_that_is_not_a_scale_file(bases, tmp_path, capsys):
    from qatfactory.faces.cli import main
    weights = tmp_path / "model.safetensors"                 # --out pointed at the user's weights by mistake
    weights.write_bytes((bases["ct_mxfp4"] / "model.safetensors").read_bytes())
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for victim in (weights, notes):
        before = victim.read_bytes()
        capsys.readouterr()
        assert main(["scales", "extract", str(bases["ct_mxfp4"]), "--out", str(victim)]) == BAD_INPUT
        err = capsys.readouterr().err
        assert "is not a qatfactory scale file" in err and "Nothing was changed" in err
        assert victim.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.txt"]
    # an earlier scale file is ours: extracted again over it
    f = tmp_path / "base.scales.safetensors"
    assert main(["scales", "extract", str(bases["ct_mxfp4"]), "--out", str(f)]) == 0
    first = f.read_bytes()
    assert main(["scales", "extract", str(bases["ct_mxfp4"]), "--out", str(f)]) == 0
    assert N.load_scale_file(f)[1]["kind"] == "qatfactory_scales" and len(f.read_bytes()) == len(first)


def _rewrite(f, out, change):
    """A copy of scale file ``f`` at ``out`` with ``change(tensors)`` applied and the same metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(f), "pt") as g:
        meta, t = g.metadata(), {k: g.get_tensor(k).clone() for k in g.keys()}
    change(t)
    save_file(t, str(out), metadata=meta)
    return out


def _apply(capsys, base, f, out):
    from qatfactory.faces.cli import main
    capsys.readouterr()
    rc = main(["scales", "apply", "--base", str(base), "--scales", str(f), "--out", str(out), "--quiet"])
    c = capsys.readouterr()
    return rc, c.out, c.err.strip().splitlines()


def _trained_file(ck, path, sigma, **kw):
    model = N.build_model(ck, targets=kw.pop("targets", ("*",)))
    torch.manual_seed(3)
    with torch.no_grad():
        for m in N.adapter_modules(model).values():
            if m.theta.requires_grad:
                m.theta.normal_(0, sigma)
    N.save_scale_file(model, ck, path, **kw)
    return path


def test_scale_file_refuses_bytes_its_layout_cannot_hold(bases, tmp_path, capsys):
    """Every E4M3 sign bit set (every block negated), one NaN byte (E4M3 0x7F / 0xFF, E8M0 0xFF): refused in one
    line naming the tensor, nothing written (no output, no .FAILED)."""
    for base, flips in (("ct_nvfp4", ((lambda t: t | 0x80, "sign bit"), (lambda t: t.fill_(0x7F), "NaN"),
                                      (lambda t: t.fill_(0xFF), "NaN"))),
                        ("ct_mxfp4", ((lambda t: t.fill_(0xFF), "NaN"),))):
        for i, (flip, what) in enumerate(flips):
            ck = N.read_native(bases[base])
            f = _trained_file(ck, tmp_path / f"{base}.scales.safetensors", 0.3)
            name = sorted(ck.packed)[1]

            def change(t):
                if what == "sign bit":
                    for k in t:
                        t[k] = flip(t[k])
                else:
                    flip(t[name][0:1, 0:1])
            bad = _rewrite(f, tmp_path / f"bad-{base}-{i}.safetensors", change)
            out = tmp_path / f"out-{base}-{i}"
            rc, _, err = _apply(capsys, bases[base], bad, out)
            assert rc == BAD_INPUT and len(err) == 1 and what in err[0] and ".weight: scale byte 0x" in err[0], err
            assert not out.exists() and not out.with_name(out.name + ".FAILED").exists()
            with pytest.raises(BadInputError, match=what):
                N.load_scale_file(bad)                        # also without a base (the in-memory swap)


def test_scale_file_applies_only_onto_the_base_it_was_trained_on(bases, tmp_path, capsys):
    """Same E2M1 codes, another per-tensor scale: the file's bytes would mean other weights. Refused naming
    the tensor and both scales; so is a file without the fingerprint (an older version)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    ck = N.read_native(bases["ct_nvfp4"])
    f = _trained_file(ck, tmp_path / "t.scales.safetensors", 0.3)
    other = tmp_path / "other-base"
    shutil.copytree(bases["ct_nvfp4"], other)
    key = "model.layers.0.self_attn.o_proj.weight_global_scale"
    with safe_open(str(other / "model.safetensors"), "pt") as g:
        meta, sd = g.metadata(), {k: g.get_tensor(k) for k in g.keys()}
    sd[key] = sd[key] * 2
    save_file(sd, str(other / "model.safetensors"), metadata=meta)
    ck2 = N.read_native(other)
    assert ck2.code_plane_sha256() == ck.code_plane_sha256()         # the codes are the same
    rc, _, err = _apply(capsys, other, f, tmp_path / "o")
    assert rc == BAD_INPUT and len(err) == 1 and "model.layers.0.self_attn.o_proj.weight" in err[0] \
        and "per-tensor scale" in err[0], err
    assert not (tmp_path / "o").exists()
    # another code in one tensor: named too
    ck3 = N.read_native(bases["ct_nvfp4"])
    ck3.packed[key[: -len("_global_scale")]].codes[0, 0] ^= 0x11
    with pytest.raises(N.CodePlaneError, match="o_proj.weight: trained on codes"):
        N.load_scale_file(f, ck3)
    # a file of the first version (no per-tensor fingerprint): refused, it cannot be checked
    v1 = _rewrite(f, tmp_path / "v1.safetensors", lambda t: None)
    with safe_open(str(v1), "pt") as g:
        meta, t = g.metadata(), {k: g.get_tensor(k) for k in g.keys()}
    meta = {k: v for k, v in meta.items() if k not in ("base_tensors", "trained", "max_changed")} | {"version": "1"}
    save_file(t, str(v1), metadata=meta)
    with pytest.raises(N.CodePlaneError, match="per-tensor fingerprint"):
        N.load_scale_file(v1, ck)


def test_scale_file_bytes_must_lie_in_the_trust_region_it_trained_under(bases, tmp_path):
    ck = N.read_native(bases["ct_nvfp4"])
    # trained under max_changed=1 %, but most bytes differ from the base: refused (the count named)
    f = _trained_file(ck, tmp_path / "wide.safetensors", 0.3, max_changed=0.01)
    with pytest.raises(BadInputError, match=r"trained blocks differ .* allows \d+ \(max_changed=0.01"):
        N.load_scale_file(f, ck)
    # the same within its region: accepted (one changed byte)
    ok = _rewrite(_trained_file(ck, tmp_path / "zero.safetensors", 0.0, max_changed=0.01),
                  tmp_path / "one.safetensors", lambda t: t[sorted(t)[0]][0:1, 0:1].add_(1))
    N.load_scale_file(ok, ck)
    # a tensor that did not train (method.scale.targets) moved: refused naming it
    f = _trained_file(ck, tmp_path / "q.safetensors", 0.3, targets=("*.q_proj",))
    N.load_scale_file(f, ck)
    moved = _rewrite(f, tmp_path / "k.safetensors",
                     lambda t: t["model.layers.0.self_attn.k_proj.weight"][0:1, 0:1].add_(1))
    with pytest.raises(BadInputError, match="k_proj.weight: 1 scale bytes differ .* did not train"):
        N.load_scale_file(moved, ck)


def test_a_failed_scales_apply_is_marked_like_every_failed_export(bases, tmp_path, capsys, monkeypatch):
    """The gate does not PASS on what apply wrote (here one code byte flipped on its way to disk): the output
    leaves OUT for OUT.FAILED with FAILED.json, exit 1."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    ck = N.read_native(bases["ct_nvfp4"])
    f = _trained_file(ck, tmp_path / "t.scales.safetensors", 0.3)
    real = N._patch_safetensors

    def flipped(ck, tensors, tmp):
        real(ck, tensors, tmp)
        with safe_open(str(tmp / "model.safetensors"), "pt") as g:
            meta, sd = g.metadata(), {k: g.get_tensor(k) for k in g.keys()}
        k = next(k for k in sorted(sd) if k.endswith("o_proj.weight_packed"))
        sd[k][0, 0] ^= 0x11
        save_file(sd, str(tmp / "model.safetensors"), metadata=meta)
    monkeypatch.setattr(N, "_patch_safetensors", flipped)
    out = tmp_path / "task"
    rc, text, _ = _apply(capsys, bases["ct_nvfp4"], f, out)
    assert rc == 1 and "verdict: FAIL" in text and str(tmp_path / "task.FAILED") in text
    assert not out.exists()
    assert json.loads((tmp_path / "task.FAILED" / "FAILED.json").read_text())["verdict"] == "FAIL"


def test_claimed_sizes_are_checked_against_the_tensors_before_a_model_is_built(bases, tmp_path):
    """A base whose metadata claims 200 million layers (GGUF) or 4,000 (config.json) over a few is refused in one
    line naming the claim and what the tensors hold, in about the time of reading the file: nothing is built
    from the claim first."""
    import json as _json
    import shutil
    import time

    import gguf as _gguf
    g = tmp_path / "g"
    shutil.copytree(bases["gguf_nvfp4"], g)
    r = _gguf.GGUFReader(str(g / "model.gguf"), "r+")
    f = r.fields["llama.block_count"]
    f.parts[f.data[0]][0] = 200_000_000
    del r
    s = tmp_path / "s"
    shutil.copytree(bases["ct_nvfp4"], s)
    cfg = _json.loads((s / "config.json").read_text())
    cfg["num_hidden_layers"] = 4000
    (s / "config.json").write_text(_json.dumps(cfg))
    for path, claim in ((g, r"num_hidden_layers=200000000 claimed; the tensors hold \d+ layer"),
                        (s, r"num_hidden_layers=4000 claimed; the tensors hold \d+ layer")):
        t = time.time()
        with pytest.raises(BadInputError, match=claim) as e:
            N.build_model(N.read_native(path))
        assert e.value.exit_code == BAD_INPUT and "\n" not in str(e.value)
        assert time.time() - t < 30
