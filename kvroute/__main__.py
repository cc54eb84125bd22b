from kvroute.cli import main

raise SystemExit(main())
