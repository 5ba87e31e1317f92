"""One checkpoint loader for target and draft: native tensor names -> parameters (``names``), the strict loader
(``loader``)."""
