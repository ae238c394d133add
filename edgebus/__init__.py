"""The ``edgebus`` command line and the settings it loads: the top of the import stack."""
