"""``policy=pooled_flow``: a policy added as this one folder (``config``: its options and entry; ``model``)."""
