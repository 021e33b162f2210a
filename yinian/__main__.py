from yinian.cli import main

raise SystemExit(main())
