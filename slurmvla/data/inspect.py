"""``python -m slurmvla.data.inspect`` (moved up to ``python -m slurmvla.inspect``): a program composes the
configuration and asks the policy what its samples need, both above the data layer."""

if __name__ == "__main__":
    from slurmvla.inspect import main

    main()
