"""The `posttrain` command line (`cli.main`): validate and run recipes (`main`), build the tiny model and data
(`build`), report on runs (`report`) and manage the local services (`services`)."""
