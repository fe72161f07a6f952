"""Print the shim folder of the hpkit this Python imports (the rendered script puts it on PYTHONPATH)."""

from hpkit.compat import main

raise SystemExit(main())
