from omniloop.serve.cli import main

raise SystemExit(main())
