from cohort_grpo.cli.main import exit_process, main

exit_process(main())
