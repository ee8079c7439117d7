"""The supported matrix as data: every cell the tests export and gate, and the README section made
from the same list (``python -m qatfactory.exporters.matrix`` prints it; tests/test_readme.py keeps
the README equal to it; the parametrized gate tests export and gate every cell, and
tests/exporters/test_exporters_matrix.py checks that each runs exactly once).

A cell is one tiny student (architecture, tie, weight/activation formats, per-module rules) written
for one engine/flavour. The students are built by tests/test_exporters_helpers.py (``cell_student``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

# tiny student kinds: architecture as the engine sees it, MoE, tied embeddings
KINDS = {
    "llama": ("llama", False, False), "qwen2": ("qwen2", False, False), "qwen3": ("qwen3", False, False),
    "qwen3_moe": ("qwen3moe", True, False), "mixtral": ("mixtral", True, False),
    "llama_tied": ("llama", False, True), "qwen3_tied": ("qwen3", False, True),
    # Gemma 3 text (gemma3_text): tied as every Gemma, (1 + w) norms, sliding-window layers
    "gemma3": ("gemma3", False, True),
    # Qwen3.5 dense text (qwen3_5_text): Gated DeltaNet layers and gated full attention
    "qwen3_5": ("qwen3_5", False, False),
}
ATTN_Q8 = (("pattern", "*.self_attn.*"), ("weight", "q8_0"))
MLP_Q5 = (("pattern", "*.mlp.*"), ("weight", "q5_0"))
# the ParetoQ low-bit grids (formats/intgrid.py): two GGUF types per student
ATTN_LSQ2 = (("pattern", "*.self_attn.*"), ("weight", "int2_lsq"))
MLP_TQ1 = (("pattern", "*.mlp.*"), ("weight", "ternary_seq_tq1"))
ATTN_BIN_Q40 = (("pattern", "*.self_attn.*"), ("weight", "binary_sign_q4_0"))
MLP_BIN_TQ1 = (("pattern", "*.mlp.*"), ("weight", "binary_sign_tq1"))


@dataclass(frozen=True)
class Cell:
    engine: str                       # vllm | sglang | llama_cpp
    flavour: str                      # modelopt | compressed-tensors | gguf
    kind: str                         # a KINDS key
    fmt: str                          # weight format (or the q4_k_m policy)
    act: Optional[str] = None         # activation format (W4A4) or None (W4A16)
    rules: Tuple = ()                 # per-module rules, as tuples of (key, value) pairs
    exclude: Tuple[str, ...] = ()     # extra modules kept in the model dtype
    preset: Optional[str] = None      # a QuantConfig preset instead of fmt/act

    @property
    def id(self) -> str:
        r = "".join(f"+{dict(x)['weight']}" for x in self.rules)
        e = "-bf16attn" if self.exclude else ""
        return f"{self.engine}-{self.flavour}-{self.kind}-{self.fmt}{r}{e}-{'w4a4' if self.act else 'w4a16'}"

    @property
    def arch(self) -> str:
        return KINDS[self.kind][0]

    @property
    def moe(self) -> bool:
        return KINDS[self.kind][1]

    @property
    def tied(self) -> bool:
        return KINDS[self.kind][2]


V, S, L = "vllm", "sglang", "llama_cpp"
MO, CT, G = "modelopt", "compressed-tensors", "gguf"
SELF_ATTN = ("*.self_attn.*",)

CELLS: List[Cell] = [
    # ---- safetensors, ModelOpt NVFP4
    Cell(V, MO, "llama", "nvfp4", "nvfp4_act"),
    Cell(S, MO, "qwen3_moe", "nvfp4", "nvfp4_act"),
    Cell(S, MO, "qwen2", "nvfp4"),
    Cell(V, MO, "mixtral", "nvfp4"),
    Cell(S, MO, "mixtral", "nvfp4", "nvfp4_act"),
    Cell(V, MO, "llama_tied", "nvfp4", "nvfp4_act"),
    Cell(S, MO, "qwen3_tied", "nvfp4"),
    # ---- safetensors, compressed-tensors NVFP4
    Cell(V, CT, "llama", "nvfp4", "nvfp4_act"),
    Cell(V, CT, "qwen3_moe", "nvfp4"),
    Cell(S, CT, "qwen3", "nvfp4", "nvfp4_act"),
    Cell(V, CT, "mixtral", "nvfp4", "nvfp4_act"),
    Cell(S, CT, "llama_tied", "nvfp4", "nvfp4_act"),
    # ---- safetensors, compressed-tensors MXFP4 (any OCP scale rule)
    Cell(V, CT, "qwen3", "mxfp4"),
    Cell(V, CT, "qwen3", "mxfp4_even"),
    Cell(V, CT, "qwen3_moe", "mxfp4_rceil", "mxfp4_rceil"),
    Cell(S, CT, "qwen3_moe", "mxfp4", exclude=SELF_ATTN),
    Cell(V, CT, "mixtral", "mxfp4"),
    Cell(S, CT, "mixtral", "mxfp4", exclude=SELF_ATTN),
    Cell(V, CT, "qwen3_tied", "mxfp4"),
    # ---- safetensors, compressed-tensors int4 pack-quantized W4A16 (the 4-bit LSQ grid; bf16 students, so
    # the scales live on the bf16 grid vLLM loads them in)
    Cell(V, CT, "llama", "int4_lsq_bf16"),
    Cell(V, CT, "qwen3", "int4_lsq_g128_bf16"),
    # ---- GGUF for llama.cpp
    Cell(L, G, "llama", "q4_k_m"),
    Cell(L, G, "llama", "nvfp4", "nvfp4_act"),
    Cell(L, G, "llama", "mxfp4_even"),
    Cell(L, G, "qwen3_moe", "nvfp4", "nvfp4_act"),
    Cell(L, G, "qwen3_moe", "mxfp4"),
    Cell(L, G, "qwen3_moe", "mxfp4_ggml", rules=(ATTN_Q8,)),
    Cell(L, G, "qwen3", "mxfp4"),
    Cell(L, G, "qwen3", "nvfp4_ggml", rules=(MLP_Q5,)),
    Cell(L, G, "qwen2", "mxfp4"),
    Cell(L, G, "mixtral", "q4_k_m", preset="q4_k"),
    Cell(L, G, "mixtral", "mxfp4_ggml", rules=(ATTN_Q8,)),
    Cell(L, G, "mixtral", "nvfp4", "nvfp4_act"),
    Cell(L, G, "llama_tied", "nvfp4", "nvfp4_act"),
    Cell(L, G, "llama_tied", "q4_k_m", preset="q4_k"),
    Cell(L, G, "qwen3_tied", "mxfp4"),
    Cell(L, G, "qwen3_tied", "q4_k_m", preset="q4_k"),
    # ParetoQ grids: Q4_0 / Q3_K / Q2_K / TQ2_0 / TQ1_0 (and the Q4_0 variants of the smaller grids)
    Cell(L, G, "llama", "int4_lsq"),
    Cell(L, G, "qwen3", "int3_lsq"),
    Cell(L, G, "llama", "int2_seq", rules=(ATTN_LSQ2,)),
    Cell(L, G, "llama", "ternary_seq", rules=(MLP_TQ1,)),
    Cell(L, G, "qwen3", "binary_sign", rules=(ATTN_BIN_Q40, MLP_BIN_TQ1)),
    Cell(L, G, "qwen2", "int2_seq_q4_0"),
    # ---- Gemma 3 (text): vLLM both flavours, llama.cpp's gemma3 (no per-tensor-scale formats: its graph never
    # applies a .scale, so ModelOpt-numerics nvfp4 is refused for it and nvfp4_ggml stands in)
    Cell(V, MO, "gemma3", "nvfp4", "nvfp4_act"),
    Cell(V, CT, "gemma3", "nvfp4"),
    Cell(V, CT, "gemma3", "mxfp4"),
    Cell(L, G, "gemma3", "mxfp4"),
    Cell(L, G, "gemma3", "nvfp4_ggml", rules=(MLP_Q5,)),
    # ---- Qwen3.5 dense (hybrid Gated DeltaNet + gated attention): vLLM both flavours; no GGUF writer yet
    Cell(V, MO, "qwen3_5", "nvfp4", "nvfp4_act"),
    Cell(V, CT, "qwen3_5", "nvfp4"),
    Cell(V, CT, "qwen3_5", "mxfp4"),
]

# What proves each flavour (the third-party code the gate runs), for the README
PROVEN_BY = {
    MO: "bytes equal the student's; nvidia-modelopt's own `NVFP4QTensor.dequantize` decodes every tensor exactly "
        "(plus a labelled transcription of vLLM's `dequantize_to_dtype`); a transformers model built from the "
        "export's config.json and those weights gives bit-identical logits; `hf_quant_config.json`, "
        "`quantization_config`, `exclude_modules` and every config value checked against the student. vLLM itself "
        "has no CPU kernel for it: the engine runs only on the GPU (benchmarks/gpu)",
    CT: "bytes equal the student's (int4: compressed-tensors' own `unpack_from_int32`); compressed-tensors' "
        "`QuantizationConfig` and compressors (exact; NVFP4 within 1 bf16 ulp, CT divides by G = 1/S); `apply_quantization_config` on a transformers skeleton quantizes "
        "exactly the student's linears; transformers `CompressedTensorsConfig(dequantize=True)` logits bit-identical "
        "(NVFP4 MoE: rebuilt from CT's decode, transformers drops the expert global scale). vLLM/SGLang run only on "
        "the GPU (benchmarks/gpu)",
    G: "bytes equal the student's (Q/K un-permuted with transformers' GGUF code, names from gguf-py's table); "
       "gguf-py and libggml's C dequantizers decode exactly (NVFP4 x `.scale` within 1 fp32 ulp); every "
       "hyperparameter via gguf-py and transformers' GGUF mapping equal to the student's; transformers' GGUF "
       "loader (or a model rebuilt from gguf-py's decode) bit-identical logits; llama.cpp's own runtime "
       "(llama-cpp-python, in `make test`) against a reference with llama.cpp's Q8 activation rounding. The "
       "Q4_K_M per-tensor type choice (`q4_k_m`) is a TRANSCRIPTION of llama.cpp's llama-quant.cpp until a run of "
       "llama-quantize confirms it",
}
# The engine itself loading the flavour's exports: the last GPU runs of benchmarks/gpu/engines.sh, whose
# numbers are in benchmarks/results/engines_h200_20261201/ (vLLM) and engines_sglang_h100_20261206/ (SGLang);
# tests/test_readme.py keeps them equal
ENGINE_RUN_ON = "vLLM 0.24.0 on one H200, 2026-12-01; SGLang 0.5.17 on one H100, 2026-12-06; torch 2.11.0+cu130"
ENGINE_RUNS: Dict[Tuple[str, str], str] = {
    (V, CT): "yes: SmolLM2-135M QAD students, Marlin FP4 kernels (weight-only on Hopper); run of 2026-12-01, the GPU "
             "to itself. NVFP4 W4A16: KL to the student 0.0017 (its PTQ baseline 0.13), top-1 0.979, greedy tokens "
             "equal 0.484, tok/s 1.19x / 0.77x bf16 (batch 1 / 64); MXFP4 W4A16: 0.0019 (PTQ 0.36), top-1 0.973, "
             "greedy 0.486, 1.02x / 0.63x; MXFP4 W4A4: served weight-only (KL 0.0015 to the student's weight-only "
             "forward, 0.44 to its W4A4 forward), 1.14x / 0.77x; tiny random Qwen3-MoE NVFP4 W4A16: Marlin MoE "
             "experts, KL to the student 0.00002, top-1 0.947, 1.19x / 0.72x",
    (V, MO): "yes: SmolLM2-135M QAD students, Marlin FP4 (weight-only on Hopper); run of 2026-12-01. NVFP4 W4A16: KL "
             "to the student 0.0017 (PTQ 0.13), top-1 0.979, greedy tokens equal 0.506, tok/s 0.95x / 0.71x bf16; "
             "NVFP4 W4A4: served weight-only (KL 0.0016 to the student's weight-only forward, 0.17 to its W4A4 "
             "forward), 1.19x / 0.75x; with an FP8 KV cache see the KV-cache section of benchmarks/RESULTS.md",
    (S, MO): "yes: SGLang 0.5.17 (the release pinning torch 2.11), one H100, 2026-12-06: a random Llama with "
             "SmolLM2's tokenizer and heads but hidden 768 (every linear on a tile of SGLang's FP4 Marlin), QAD "
             "NVFP4 W4A4, served weight-only through that Marlin on SM90 (quant_algo NVFP4 -> modelopt_fp4), CUDA "
             "graphs: KL 0.00006 to the student's weight-only forward (its PTQ baseline 0.0265), top-1 0.973, tok/s "
             "0.96x / 0.93x its bf16 (batch 1 / 64); bf16 SmolLM2 859 / 44,243 tok/s. No SmolLM2-135M NVFP4 "
             "checkpoint runs in SGLang on Hopper, ours or another's: its fused q/k/v (K = 576, N = 960) fits no "
             "Marlin tile (the first CUDA-graph capture stops, H200, 2026-12-03). Read from its source: "
             "ModelOptFp4Config refuses W4A16_NVFP4 unless MIXED_PRECISION",
    (S, CT): "not run yet (as above)",
    (L, G): "yes, on every cell in `make test` (below)",
}
ENGINE_NAMES = {V: "vLLM", S: "SGLang", L: "llama.cpp"}
FLAVOUR_NAMES = {MO: "ModelOpt (`hf_quant_config.json` + `quantization_config`)",
                 CT: "compressed-tensors (`nvfp4-pack-quantized` / `mxfp4-pack-quantized` / int4 `pack-quantized`)",
                 G: "GGUF"}
REFUSED = [
    ("SGLang", "compressed-tensors", "`mxfp4*` on dense (non-expert) linears",
     "refused: SGLang has no dense CT-MXFP4 scheme; keep attention bf16 (the cells above) or use NVFP4"),
    ("vLLM, SGLang", "any", "ggml-only formats (`q4_k`, `q5_0`, `q6_k`, `q8_0`, `mxfp4_ggml`, `nvfp4_ggml`, the 3/2/"
     "1.58/1-bit ParetoQ grids); MXFP4 and int4 in the ModelOpt flavour", "refused with the reason and the alternative"),
    ("llama.cpp", "GGUF", "Gemma 3 with per-tensor-scaled formats (`nvfp4`, ModelOpt numerics)",
     "refused: llama.cpp's gemma3 graph never applies a weight's `.scale`; use `nvfp4_ggml` or MXFP4"),
    ("llama.cpp", "GGUF", "Qwen3.5 (`qwen35`)", "refused: no GGUF writer for its Gated DeltaNet tensors yet"),
    ("vLLM", "compressed-tensors", "int4 grids whose fp16 scales the model dtype cannot hold (`int4_lsq` in a bf16 "
     "model)", "refused: vLLM loads weight_scale in the model dtype; use `int4_lsq_bf16` / `int4_lsq_g128_bf16`"),
]

# llama.cpp runtime, measured by benchmarks/llama_cpp_runtime.py: the gate's own numbers on each GGUF
# cell: (prompts agreeing to float order, KL < 1e-12; prompts; worst KL(reference || llama.cpp) with the
# Q8 activation rounding emulated; the same without the emulation; max relative logit difference on
# the first prompt, emulated)
MEASURED_ON = ("2026-12-01, llama.cpp 0c1e570 via llama-cpp-python 0.3.36, x86-64 with AVX-512 (plain CPU "
               "backend, F32 KV cache; the Gemma 3 cells 2026-12-07, same build, AMD EPYC with AVX-512)")
MEASURED: Dict[str, Tuple[int, int, float, float, float]] = {
    'llama_cpp-gguf-llama-q4_k_m-w4a16': (3, 4, 2.7e-08, 0.00036, 0.00018),
    'llama_cpp-gguf-llama-nvfp4-w4a4': (3, 4, 2.8e-06, 0.00019, 1.9e-07),
    'llama_cpp-gguf-llama-mxfp4_even-w4a16': (4, 4, 2.6e-14, 0.00017, 2.2e-07),
    'llama_cpp-gguf-qwen3_moe-nvfp4-w4a4': (1, 4, 4.1e-07, 0.00048, 2.2e-07),
    'llama_cpp-gguf-qwen3_moe-mxfp4-w4a16': (4, 4, 2.1e-14, 0.089, 2.9e-07),
    'llama_cpp-gguf-qwen3_moe-mxfp4_ggml+q8_0-w4a16': (1, 4, 1.6e-05, 0.00042, 0.0058),
    'llama_cpp-gguf-qwen3-mxfp4-w4a16': (3, 4, 2.4e-05, 0.00019, 0.0052),
    'llama_cpp-gguf-qwen3-nvfp4_ggml+q5_0-w4a16': (2, 4, 3.2e-05, 0.00018, 2e-07),
    'llama_cpp-gguf-qwen2-mxfp4-w4a16': (2, 4, 1.7e-05, 0.00019, 4.3e-07),
    'llama_cpp-gguf-mixtral-q4_k_m-w4a16': (2, 4, 8.8e-06, 0.017, 0.0037),
    'llama_cpp-gguf-mixtral-mxfp4_ggml+q8_0-w4a16': (3, 4, 2.6e-08, 0.00014, 0.00019),
    'llama_cpp-gguf-mixtral-nvfp4-w4a4': (1, 4, 8.1e-06, 0.0003, 0.0026),
    'llama_cpp-gguf-llama_tied-nvfp4-w4a4': (3, 4, 1e-05, 6.5e-05, 2.4e-07),
    'llama_cpp-gguf-llama_tied-q4_k_m-w4a16': (3, 4, 2e-09, 5.9e-05, 0.00011),
    'llama_cpp-gguf-qwen3_tied-mxfp4-w4a16': (4, 4, 9.9e-15, 0.00014, 1.9e-07),
    'llama_cpp-gguf-qwen3_tied-q4_k_m-w4a16': (3, 4, 1.7e-05, 0.00014, 0.0084),
    'llama_cpp-gguf-llama-int4_lsq-w4a16': (2, 4, 8.3e-06, 0.00022, 0.0031),
    'llama_cpp-gguf-qwen3-int3_lsq-w4a16': (2, 4, 2.3e-08, 0.00042, 3.5e-07),
    'llama_cpp-gguf-llama-int2_seq+int2_lsq-w4a16': (2, 4, 2.8e-08, 0.0004, 0.00024),
    'llama_cpp-gguf-llama-ternary_seq+ternary_seq_tq1-w4a16': (2, 4, 3e-06, 0.00039, 0.0023),
    'llama_cpp-gguf-qwen3-binary_sign+binary_sign_q4_0+binary_sign_tq1-w4a16': (2, 4, 9.2e-06, 0.00025, 2.2e-07),
    'llama_cpp-gguf-qwen2-int2_seq_q4_0-w4a16': (1, 4, 3.3e-05, 0.00018, 1.5e-06),
    # the Gemma 3 cells: 2026-12-07, the same llama.cpp build, an AMD EPYC with AVX-512
    'llama_cpp-gguf-gemma3-mxfp4-w4a16': (4, 4, 1.8e-15, 5.5e-05, 1.4e-07),
    'llama_cpp-gguf-gemma3-nvfp4_ggml+q5_0-w4a16': (3, 4, 2.5e-06, 5.4e-05, 1.4e-07),
}
# the same gate on a real model (not a cell: SmolLM2-135M-Instruct, PTQ Q4_K_M, 4 prompts of 12 tokens)
REAL_MODEL = ("SmolLM2-135M-Instruct Q4_K_M (30 layers): KL to llama.cpp 0.008-0.016 per prompt with the rounding "
              "emulated, 0.02-0.05 without; the Q8 rounding's own KL 0.017-0.047; argmax equal at all 11 decisive "
              "positions (44 of 48 overall): in a deep model the boundary events re-draw the rounding on every prompt")


def _fmt_list(cells: List[Cell]) -> str:
    seen = []
    for c in cells:
        w = f"`{c.fmt}`" + "".join(f" + `{dict(x)['weight']}` ({dict(x)['pattern']})" for x in c.rules)
        w += (f" W4A4 (`{c.act}`)" if c.act else " W4A16")
        if c.exclude:
            w += " with attention bf16"
        if w not in seen:
            seen.append(w)
    return "; ".join(seen)


def _archs(cells: List[Cell]) -> str:
    out = []
    for c in cells:
        a = c.arch + (" (tied)" if c.tied else "")
        if a not in out:
            out.append(a)
    return ", ".join(out)


def markdown() -> str:
    lines = [
        "Generated by `python -m qatfactory.exporters.matrix` from the list of cells (exporters/matrix.py) that "
        "the parametrized gate tests export and run through the parity gate in `make test`, one test per cell, "
        "every one required to give PASS (tests/exporters/test_exporters_matrix.py checks that each cell runs "
        "exactly once; "
        "tiny random students through the real quantize.prepare/calibrate/convert). Verdicts: **PASS** "
        "(every required check ran and agreed), **FAIL** (exit 1; names the tensor and the check), **INCOMPLETE** "
        "(exit 2; a required third-party tool is missing, or a check was opted out of; never a pass).",
        "",
        "| engine | flavour | weights / activations | architectures | dense | MoE | tied | cells | proven by | "
        f"loaded by the engine itself ({ENGINE_RUN_ON}; benchmarks/RESULTS.md) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: Dict[Tuple[str, str], List[Cell]] = {}
    for c in CELLS:
        groups.setdefault((c.engine, c.flavour), []).append(c)
    for (engine, flavour), cells in groups.items():
        lines.append(
            f"| {ENGINE_NAMES[engine]} | {FLAVOUR_NAMES[flavour]} | {_fmt_list(cells)} | {_archs(cells)} | "
            f"{'yes' if any(not c.moe for c in cells) else 'no'} | {'yes' if any(c.moe for c in cells) else 'no'} | "
            f"{'yes' if any(c.tied for c in cells) else 'no'} | {len(cells)} | {PROVEN_BY[flavour]} | "
            f"{ENGINE_RUNS.get((engine, flavour), 'not run')} |")
    for eng, fl, what, why in REFUSED:
        lines.append(f"| {eng} | {fl} | {what} | | | | | | {why} | |")
    g = [c for c in CELLS if c.engine == L]
    lines += ["", f"llama.cpp's own runtime runs on every GGUF cell in `make test` ({MEASURED_ON}). The gate compares "
              "its logits with the student's forward in which every matmul input is rounded as llama.cpp's CPU "
              "backend rounds it (Q8_K for k-quant weights, Q8_0 for Q5_0/Q8_0/MXFP4/NVFP4, bf16 for BF16; the "
              "rules are checked against llama.cpp's own `from_float` in tests/exporters/test_llama_cpp_emulation.py). "
              "Boundary events (a rounding that llama.cpp's last-bit-different input tips the other way) re-draw "
              "part of the later roundings, so the bound is measured on the same prompts: on each of four prompts "
              "KL <= max(0.1 x the Q8 rounding's own KL, 2 x the KL of tipping every rounding within float noise "
              "of its boundary), on one of them within one tipping effect, and the argmax equal wherever the Q8 "
              "effect cannot swap it (exporters/verify/llama_cpp_runtime.py).", "",
              "| GGUF cell | prompts at float order (KL < 1e-12) | worst KL, rounding emulated | worst KL, not emulated | "
              "max rel. logit diff, emulated (prompt 1) |",
              "|---|---|---|---|---|"]
    for c in g:
        m = MEASURED.get(c.id)
        lines.append(f"| `{c.id}` | " + (f"{m[0]} of {m[1]} | {m[2]:.2g} | {m[3]:.2g} | {m[4]:.2g}" if m else
                                         "not measured | | | ") + " |")
    lines += ["", f"On a real model: {REAL_MODEL}."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
