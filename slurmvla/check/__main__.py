"""``python -m slurmvla.check``: the checker's command line (:func:`slurmvla.check.main`)."""

from slurmvla.check import main

main()
