"""DESIGN rule 5: importing qatfactory needs neither a GPU nor DeepSpeed nor CuPy."""
import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent("""
    import importlib.abc, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("deepspeed", "cupy", "cupyx"):
                raise ImportError(f"{name} is blocked by the test")
            return None
    sys.meta_path.insert(0, _Block())
""")


def test_import_without_deepspeed_cupy_or_gpu():
    code = BLOCK + textwrap.dedent("""
        import torch
        import qatfactory, qatfactory.formats, qatfactory.kernels, qatfactory.nn, qatfactory.quantize
        import qatfactory.exporters, qatfactory.distill, qatfactory.train.config, qatfactory.faces.cli
        from qatfactory.formats import get_format
        x = torch.randn(4, 64)
        from qatfactory import kernels
        assert torch.equal(kernels.fake_quantize(x, "nvfp4"), get_format("nvfp4").fake_quantize(x))
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
