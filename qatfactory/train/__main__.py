"""``python -m qatfactory.train method=qad format=nvfp4_w4a16 ...`` (one process), or under the launcher:
``deepspeed --num_gpus N -m qatfactory.train ...`` (the launcher's --local_rank argument is accepted)."""
import sys


def main(argv=None) -> int:
    from ..cli import train_main
    return train_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
