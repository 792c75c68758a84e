"""Exceptions whose message is shown to the user as one line (the stage scripts exit non-zero on them)."""


class AtlasflowError(Exception):
    """Base class: a problem with the user's input, configuration or environment, explained in one line."""


class InputError(AtlasflowError):
    """Input data that cannot be read or is not what the stage expects (missing file, bad values, ...)."""


class StoreError(AtlasflowError):
    """A Zarr store that is missing, damaged or lacks what a stage needs."""


class ConfigError(AtlasflowError):
    """A configuration key with a wrong value or type."""


class ClusterError(AtlasflowError):
    """The Dask scheduler cannot be reached or the cluster cannot start."""


class OutputError(AtlasflowError):
    """An output path holds something atlasflow did not write (or is one of the inputs): refused, kept."""
