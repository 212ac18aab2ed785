"""``python -m slurmvla.data.inspect`` (moved up to ``python -m slurmvla.inspect``): a program composes the
configuration and asks the policy what its samples need, both above the data layer."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("slurmvla.inspect", run_name="__main__", alter_sys=True)
