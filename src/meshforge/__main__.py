from meshforge.cli import main

raise SystemExit(main())
