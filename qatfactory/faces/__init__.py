"""The faces: what a user runs. ``cli`` (``qatfactory train | export | verify | eval | scales | demo``),
``export`` and ``scales`` (their commands), ``eval`` (held-out perplexity and downstream tasks through
lm-evaluation-harness), ``ship`` (export + the parity gate after a run), ``demo`` with its report and its
llama.cpp helpers. Faces import the trainer and the exporters; nothing below imports a face."""
