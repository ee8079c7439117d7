"""``python -m qatfactory.train method=qad format=nvfp4_w4a16 ...`` (one process), or under the launcher:
``deepspeed --num_gpus N -m qatfactory.train ...`` (the launcher's --local_rank argument is accepted).

This file is a face, not part of the trainer: the entry point the launcher runs, the same as
``qatfactory train`` (cli.train_main: train, then ship the student). Nothing imports it."""
import sys

from .. import _quiet
from ..faces.cli import train_main


def main(argv=None) -> int:
    _quiet.install()
    return train_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
