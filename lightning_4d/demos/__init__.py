"""What the README, the docs and ``examples/`` train: a plain GPT (:mod:`lightning_4d.demos.gpt`), a byte-level
text DataModule over Python's own standard library (:mod:`lightning_4d.demos.data`) and a loss-printing
callback (:mod:`lightning_4d.demos.callbacks`). They ship inside the package so that a snippet from the docs runs
from any directory after ``pip install``. Nothing here knows about parallelism."""
