"""``python -m posenc_torch.hf.verify``: see the package docstring."""

from . import main

raise SystemExit(main())
