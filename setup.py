"""qatfactory: quantization-aware training and distillation aligned with the serving format."""
from setuptools import find_packages, setup

setup(
    name="qatfactory",
    version="0.1.0",
    description="Quantization-aware training/distillation for NVFP4, MXFP4 and Q4_K, bit-exact with vLLM, SGLang and llama.cpp",
    python_requires=">=3.10",
    packages=find_packages(include=["qatfactory", "qatfactory.*"])
    + ["qatfactory.exporters", "qatfactory.exporters.verify"],
    package_dir={"qatfactory.exporters": "exporters"},
    package_data={"qatfactory": ["../csrc/*.cu", "../csrc/*.cuh", "eval_tasks/*.yaml", "eval_tasks/*.py"]},
    install_requires=[
        "torch>=2.4",
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
            "ruff==0.17.6",   # make test: pyflakes rules over the package (ruff.toml)
            "ml_dtypes>=0.5",
            "torchao==0.18.0",
            "deepspeed==0.19.8",
            "peft",
            "diskcache",   # llama-cpp-python (built by scripts/llama_cpp_runtime.py) imports it
            "sentencepiece>=0.1.98,<0.3",   # llama.cpp's own convert_hf_to_gguf.py imports it for Llama vocabularies
            "lm-eval==0.4.13", "accelerate",   # `qatfactory eval ... tasks=` (qatfactory/harness.py)
        ],
        "eval": ["lm-eval==0.4.13", "accelerate"],
        "cuda": ["cupy-cuda13x"],
    },
    entry_points={"console_scripts": ["qatfactory=qatfactory.cli:main"]},
)
