"""python -m slurmvla_metaworld_study.auxiliary RUN DATA_ROOT | RUN --pixels FIRST_SEED END_SEED (see ``model``)."""

from slurmvla_metaworld_study.auxiliary.model import main

main()
