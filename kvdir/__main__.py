from kvdir.cli import main

raise SystemExit(main())
