"""Parts of the dataset scanner; ``burstcv.data.manifest`` is the entry point that uses them.

``listing`` finds the files, ``dispatch`` spreads them over processes, ``inspection`` turns
each into a manifest row (with ``formats`` and ``dhash``), and ``columns`` defines the row and
assembles the DataFrame. Every pixel is Pillow's, through its public API.
"""
