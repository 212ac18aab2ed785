"""``python -m slurmvla.policy.check``, the command users learnt before the checker moved to its own package:
it runs ``python -m slurmvla.check`` (by name, so the policy package imports no program)."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("slurmvla.check", run_name="__main__", alter_sys=True)
