"""GPU correctness cases and benches per op (tools.gpucheck discovers them): each module has NAME,
prepare(), cases() and run_case(case) -> dict with "name", "passed", and optionally bench_rows()
and format_rows()."""
