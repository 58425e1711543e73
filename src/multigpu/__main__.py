from multigpu.cli import main

raise SystemExit(main())
