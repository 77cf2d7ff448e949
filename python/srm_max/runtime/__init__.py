"""Running compiled MAX graphs: devices and dtypes, the engine base, the compile cache,
compiling in worker processes, CPU targets and the Mojo kernel library."""
