"""One module per workflow stage: ``add_arguments`` (parameters) and ``run(args, client)`` (the work).

Each ``run`` is I/O around a package function: open the input store lazily, call ``atlasflow.pp`` /
``atlasflow.tl``, write what changed (the rest is linked). See ``atlasflow.cli`` for the contract.
"""
