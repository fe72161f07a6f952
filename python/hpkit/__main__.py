from hpkit.cli import main

raise SystemExit(main())
