"""Layer: front-end (Accelerate). Run an unchanged Accelerate script on the zeropp engine.

    accelerate launch --config_file recipes/accelerate/zeropp.yaml \\
        -m zeropp_strategy.accelerate.launch train.py --train-args ...
    accelerate launch ... -m zeropp_strategy.accelerate.launch -m some.module --args ...

In each process, before the script runs, ``accelerate.Accelerator`` (and
``accelerate.accelerator.Accelerator``) are made to resolve to ``ZeroPPAccelerator``, so
``from accelerate import Accelerator`` in the script gets ours; the plugin settings come
from the file named by ``$ZEROPP_CONFIG`` (ZeroConfig YAML or DeepSpeed JSON; default:
stage 3). The script then runs as ``__main__`` with its own arguments in ``sys.argv``.

Nothing in the package imports this module: ``python -m`` executes it as ``__main__``,
and a copy already in ``sys.modules`` would make runpy warn and run it twice.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m zeropp_strategy.accelerate.launch (SCRIPT.py | -m MODULE) [ARGS...]"


def install() -> None:
    """Make ``accelerate.Accelerator`` resolve to ``ZeroPPAccelerator`` in this process."""
    import accelerate
    import accelerate.accelerator

    from zeropp_strategy.accelerate import ZeroPPAccelerator

    accelerate.Accelerator = ZeroPPAccelerator  # type: ignore[misc]
    accelerate.accelerator.Accelerator = ZeroPPAccelerator  # type: ignore[misc]


def use_cpu_when_no_gpu() -> None:
    """``ACCELERATE_USE_CPU=true`` when ``torchrun_without_gpu()``, for the user's own Accelerator."""
    from zeropp_strategy.accelerate import torchrun_without_gpu

    if torchrun_without_gpu():
        os.environ["ACCELERATE_USE_CPU"] = "true"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    use_cpu_when_no_gpu()
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        print(f"zeropp_strategy.accelerate.launch: {script!r} is not a file. {USAGE}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
