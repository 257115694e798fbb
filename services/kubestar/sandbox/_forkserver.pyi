# The zygote's serving loop and the forked call's runner (_forkserver.c).

ANSWER_TIMED_OUT: int
ANSWER_STDOUT_TRUNCATED: int
ANSWER_STDERR_TRUNCATED: int
ANSWER_MEMORY_ERROR: int

def move_code_to_huge_pages() -> int: ...  # bytes of the interpreter's code moved
def serve(
    *,
    fd: int,
    workdir: str,
    call_uid: int,
    kill_all: bool,
    collapse: bool,
    baseline_vm_bytes: int,
    max_file_bytes: int,
    max_open_files: int,
    max_processes: int,
    private_dirs: dict[str, list[str]],
) -> None: ...  # returns when the worker closes fd; a forked call never returns
