"""The faces that reach the source checkout (llama.cpp's build script, benchmarks/step.py) find it from
qatfactory/faces/, two levels below the repository root."""
import pytest

from qatfactory.faces import cli, llama_tools


def test_llama_tools_finds_the_runtime_build_script():
    assert (llama_tools.ROOT / "scripts" / "llama_cpp_runtime.py").is_file()
    assert (llama_tools.ROOT / "qatfactory" / "faces" / "llama_tools.py").is_file()


def test_bench_runs_the_checkouts_step_script(capsys):
    with pytest.raises(SystemExit) as e:        # step.py's own --help: the script was found and ran
        cli.bench_main(["--help"])
    assert e.value.code == 0
    assert "not found" not in capsys.readouterr().err
