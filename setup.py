"""qatfactory: quantization-aware training and distillation aligned with the serving format."""
from setuptools import find_packages, setup

setup(
    name="qatfactory",
    version="0.1.0",
    description="Quantization-aware training/distillation for NVFP4, MXFP4 and Q4_K, bit-exact with vLLM, SGLang and llama.cpp",
    # the Pythons the tests run on: 3.11 (make test) and 3.12 (the GPU image); enum.StrEnum needs 3.11
    python_requires=">=3.11,<3.13",
    # recipes/ and csrc/ stay at the top of the source tree (where users edit them) and ship inside the
    # package, where qatfactory/_recipes.py and kernels/loader.py look first on an installed copy; they
    # are data folders, not Python packages, so no __init__.py
    packages=find_packages(include=["qatfactory", "qatfactory.*"])
    + ["qatfactory.exporters", "qatfactory.exporters.verify", "qatfactory.readers", "qatfactory.recipes",
       "qatfactory.csrc"],
    package_dir={"qatfactory.exporters": "exporters", "qatfactory.readers": "readers", "qatfactory.recipes": "recipes",
                 "qatfactory.csrc": "csrc"},
    package_data={"qatfactory": ["faces/eval_tasks/*.yaml", "faces/eval_tasks/*.py"],
                  "qatfactory.recipes": ["*.yaml", "*/*.yaml"],
                  "qatfactory.csrc": ["*.cu", "*.cuh"]},
    install_requires=[
        # the torch releases the tests run on: 2.13 (make test, CPU) and 2.11 (the GPU image); a newer
        # one is untested, and pip would otherwise take the newest
        "torch>=2.11,<2.14",
        # the trainer is DeepSpeed's engine on one process as on many (its optimizer step, checkpoints,
        # ZeRO), so a one-process run resumes on eight; the lean step mirrors 0.19's (train/ds_step.py)
        "deepspeed>=0.19,<0.20",
        "pyyaml",
        "numpy>=1.24",
        "safetensors>=0.4",
        "tqdm",
        "gguf>=0.17",
        "transformers>=4.56",
        # the parity gate's third-party oracles (`qatfactory verify` is INCOMPLETE without them):
        # compressed-tensors' compressors, libggml's C dequantizers, nvidia-modelopt's NVFP4 decode.
        # llama.cpp's runtime (llama-cpp-python) builds for minutes, so it is not here: the gate names it
        # when absent, and `make test` builds it (scripts/llama_cpp_runtime.py)
        "compressed-tensors>=0.20",
        "libggml-python==0.20.2.post1",
        "nvidia-modelopt==0.47.0",
        "hydra-core>=1.3,<1.4",
        "omegaconf>=2.3,<2.4",
        "matplotlib",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",   # make test runs the suite on two workers (the CI machine's two cores)
            "setuptools>=70.1",   # tests/test_packaging.py builds the wheel in this environment (bdist_wheel built in)
            "ruff==0.17.6",   # make test: pyflakes rules over the package (ruff.toml)
            "ml_dtypes>=0.5",
            "torchao==0.18.0",
            "peft",
            "diskcache",   # llama-cpp-python (built by scripts/llama_cpp_runtime.py) imports it
            "sentencepiece>=0.1.98,<0.3",   # llama.cpp's own convert_hf_to_gguf.py imports it for Llama vocabularies
            "lm-eval==0.4.13", "accelerate",   # `qatfactory eval ... tasks=` (qatfactory/faces/eval.py)
            "auto-round==0.16.1",   # tests/benchmarks/test_accuracy_peers.py: the AutoRound peer's smoke
            "trl==1.16.0",   # examples/trl_sft_qat.py and qatfactory.integrations.transformers on TRL's SFTTrainer
        ],
        # benchmarks/accuracy's peers that install beside this project's pins (llm-compressor does not: it
        # pins transformers <= 5.17 and compressed-tensors 0.19, and runs from its own venv)
        "bench": ["auto-round==0.16.1"],
        "eval": ["lm-eval==0.4.13", "accelerate"],
        "cuda": ["cupy-cuda13x"],
    },
    entry_points={"console_scripts": ["qatfactory=qatfactory.faces.cli:main"]},
)
