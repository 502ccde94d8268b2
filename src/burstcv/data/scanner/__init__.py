"""Parts of the dataset scanner; ``burstcv.data.manifest`` is the entry point that uses them.

``listing`` finds the files, ``dispatch`` spreads them over processes, ``inspection`` turns
each into a manifest row (with ``formats``, ``pngfast``, ``dhash`` and ``strips`` as its
faster ways to the same bytes), ``capabilities`` says once which of those this Pillow allows,
and ``columns`` defines the row and assembles the DataFrame.
"""
