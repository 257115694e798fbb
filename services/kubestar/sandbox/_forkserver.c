/* The zygote's serving loop, in C: between two forks it touches no Python object.
 *
 * Each page of the zygote that it writes after a fork is a page fault (the fork shared it
 * with the call, copy-on-write), so a serving loop in Python, which writes reference counts,
 * allocator pools and frames all over the heap, paid ~170 faults a call on the light zygote.
 * This loop reads the request, forks, watches the call (wall-clock timeout, output caps),
 * reaps it and everything it left behind, answers and cleans up with its own memory only:
 * buffers mapped MADV_DONTFORK (never shared with a call) and its stack. The one buffer a
 * call shares, the code it runs, is zeroed after each call: a call never finds the code of
 * the calls before it (another trajectory's hidden tests) in its memory.
 *
 * A forked call sets itself up (process group, standard streams, working directory, rlimits,
 * uid), then compiles and runs its code as a script's `__main__` (`run_code`) and exits: it
 * never returns into Python code of the zygote, whose objects it would write. `serve(...)`
 * returns None in the zygote once the worker closes the control socket, or after a call that
 * left what cannot be removed (the zygote exits; the worker starts another). Every call of a
 * zygote runs in the same (fresh, emptied) directory, so HOME, TMPDIR and the import path are
 * set once, not per call.
 *
 * Wire format, native byte order (the worker is on the same machine):
 *   request: double timeout_seconds, u64 memory_bytes, u64 output_bytes, u32 code_bytes,
 *            u32 stdin_bytes, then the code (UTF-8) and stdin;
 *   answer:  i32 wait_status, u32 flags (ANSWER_*), double wall_ms, double cpu_ms,
 *            u32 stdout_bytes, u32 stderr_bytes, then stdout and stderr.
 * The worker turns the answer into a status (executor.py): the zygote reports what happened.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1+ */
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#define ANSWER_TIMED_OUT 1u
#define ANSWER_STDOUT_TRUNCATED 2u
#define ANSWER_STDERR_TRUNCATED 4u
#define ANSWER_MEMORY_ERROR 8u

#define READ_CHUNK 65536
#define LEFTOVER_GRACE_SECONDS 0.05
#define HUGE_PAGE (2UL * 1024 * 1024)
#define MAX_KEEP 64
/* The call's report channel: it writes "M" there when it runs out of memory. */
#define REPORT_FD 3
/* Calls are the first the OOM killer takes (the most a process can ask for). */
#define CALL_OOM_SCORE_ADJ "1000"

struct request_header {
    double timeout_seconds;
    uint64_t memory_bytes;
    uint64_t output_bytes;
    uint32_t code_bytes;
    uint32_t stdin_bytes;
};

struct answer_header {
    int32_t wait_status;
    uint32_t flags;
    double wall_ms;
    double cpu_ms;
    uint32_t stdout_bytes;
    uint32_t stderr_bytes;
};

_Static_assert(sizeof(struct request_header) == 32, "request header layout");
_Static_assert(sizeof(struct answer_header) == 32, "answer header layout");

/* Memory of the loop that a call never shares (MADV_DONTFORK), unless `shared`. */
typedef struct {
    char *data;
    size_t size;
    size_t capacity;
    int shared;
} buffer_t;

typedef struct {
    char path[PATH_MAX];
    const char *keep[MAX_KEEP]; /* names in it */
    int keep_count;
} private_dir_t;

typedef struct {
    int fd;
    char workdir[PATH_MAX]; /* each call's, created before and removed after it */
    uid_t call_uid;
    int kill_all; /* PID 1 of a PID namespace: kill(-1) reaches every leftover */
    int collapse;
    uint64_t baseline_vm_bytes;
    long long max_file_bytes, max_open_files, max_processes; /* max_processes < 0: unset */
    private_dir_t *private_dirs;
    int private_dir_count;
    unsigned long calls;
    int retire; /* a call left what could not be removed: serve no other call */
    buffer_t code, input, out, err, spill, listing;
} server_t;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int buffer_reserve(buffer_t *buffer, size_t capacity) {
    if (capacity <= buffer->capacity) {
        return 0;
    }
    size_t rounded = (capacity + 65535) & ~(size_t)65535;
    char *data = mmap(NULL, rounded, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (data == MAP_FAILED) {
        return -1;
    }
    if (!buffer->shared) {
        madvise(data, rounded, MADV_DONTFORK);
    }
    if (buffer->data != NULL) {
        memcpy(data, buffer->data, buffer->size);
        munmap(buffer->data, buffer->capacity);
    }
    buffer->data = data;
    buffer->capacity = rounded;
    return 0;
}

/* 1: read all, 0: end of file, -1: error. */
static int read_exactly(int fd, char *data, size_t size) {
    size_t done = 0;
    while (done < size) {
        ssize_t got = read(fd, data + done, size - done);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got <= 0) {
            return got == 0 && done == 0 ? 0 : -1;
        }
        done += (size_t)got;
    }
    return 1;
}

static int write_all(int fd, struct iovec *parts, int count) {
    while (count > 0) {
        ssize_t wrote = writev(fd, parts, count);
        if (wrote < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        while (count > 0 && (size_t)wrote >= parts->iov_len) {
            wrote -= (ssize_t)parts->iov_len;
            parts++;
            count--;
        }
        if (count > 0) {
            parts->iov_base = (char *)parts->iov_base + wrote;
            parts->iov_len -= (size_t)wrote;
        }
    }
    return 0;
}

static void kill_quietly(pid_t pid) { kill(pid, SIGKILL); }

/* ------------------------------------------------------------------ the call's process */

static void __attribute__((noreturn)) setup_failed(const char *what) {
    dprintf(2, "the sandbox could not set up this call: %s: %s\n", what, strerror(errno));
    _exit(1);
}

static void set_limit(int resource, rlim_t soft, rlim_t hard, const char *what) {
    struct rlimit limit = {soft, hard};
    if (setrlimit(resource, &limit) != 0) {
        setup_failed(what);
    }
}

/* The kernel's OOM killer takes the call before the worker or its zygote (whose score
 * stays as it was). The call inherits the zygote's non-dumpable state, under which its /proc
 * files belong to root and a call without capabilities (not root: a user namespace) cannot
 * open its own oom_score_adj: dumpable for the write, while nothing but this code runs in the
 * process, and not again at the end of prepare_call. */
static void raise_oom_score(void) {
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0) {
        setup_failed("prctl(PR_SET_DUMPABLE)");
    }
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, CALL_OOM_SCORE_ADJ, strlen(CALL_OOM_SCORE_ADJ)) < 0) {
        setup_failed("/proc/self/oom_score_adj");
    }
    close(fd);
}

/* In the forked call, before any Python runs: own process group (not a session: see
 * zygote.py), standard streams, no other descriptor, working directory, OOM score, rlimits,
 * uid, and not dumpable (what runs outside the call cannot open its /proc/PID/mem or
 * ptrace it). */
static void prepare_call(server_t *server, const struct request_header *request, int stdin_fd,
                         int out_write, int err_write, int report_write, const char *workdir) {
    setpgid(0, 0);
    int input = stdin_fd >= 0 ? stdin_fd : open("/dev/null", O_RDONLY);
    if (input < 0 || dup2(input, 0) < 0 || dup2(out_write, 1) < 0 || dup2(err_write, 2) < 0 ||
        dup2(report_write, REPORT_FD) < 0) {
        _exit(1);
    }
    if (syscall(SYS_close_range, 4U, ~0U, 0) != 0) {
        for (int fd = 4; fd < 65536; fd++) {
            close(fd);
        }
    }
    if (chdir(workdir) != 0) {
        setup_failed("chdir");
    }
    raise_oom_score();
    rlim_t cpu_seconds = (rlim_t)request->timeout_seconds + 1;
    set_limit(RLIMIT_CPU, cpu_seconds, cpu_seconds + 1, "RLIMIT_CPU");
    rlim_t address_space = (rlim_t)(server->baseline_vm_bytes + request->memory_bytes);
    set_limit(RLIMIT_AS, address_space, address_space, "RLIMIT_AS");
    set_limit(RLIMIT_FSIZE, (rlim_t)server->max_file_bytes, (rlim_t)server->max_file_bytes,
              "RLIMIT_FSIZE");
    set_limit(RLIMIT_NOFILE, (rlim_t)server->max_open_files, (rlim_t)server->max_open_files,
              "RLIMIT_NOFILE");
    set_limit(RLIMIT_CORE, 0, 0, "RLIMIT_CORE");
    if (server->max_processes >= 0) {
        set_limit(RLIMIT_NPROC, (rlim_t)server->max_processes, (rlim_t)server->max_processes,
                  "RLIMIT_NPROC");
    }
    if (server->call_uid != 0) {
        if (setgroups(0, NULL) != 0) {
            setup_failed("setgroups");
        }
        if (setgid(server->call_uid) != 0) {
            setup_failed("setgid");
        }
        if (setuid(server->call_uid) != 0) {
            setup_failed("setuid");
        }
    }
    /* Last: raise_oom_score made it dumpable, and a change of uid sets fs.suid_dumpable. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
        setup_failed("prctl(PR_SET_DUMPABLE)");
    }
}

/* The exit status of a call that raised SystemExit, as the interpreter gives it for a script. */
static int system_exit_status(PyObject *exit) {
    PyObject *code = PyObject_GetAttrString(exit, "code");
    int status = 1;
    if (code == NULL) {
        PyErr_Clear();
    } else if (code == Py_None) {
        status = 0;
    } else if (PyLong_Check(code)) {
        PyObject *mask = PyLong_FromLong(0xFF);
        PyObject *low = mask != NULL ? PyNumber_And(code, mask) : NULL;
        status = low != NULL ? (int)PyLong_AsLong(low) : 1;
        Py_XDECREF(low);
        Py_XDECREF(mask);
    } else {
        PyObject *err = PySys_GetObject("stderr");
        if (err != NULL && PyFile_WriteObject(code, err, Py_PRINT_RAW) == 0) {
            PyFile_WriteString("\n", err);
        }
    }
    Py_XDECREF(code);
    PyErr_Clear();
    return status;
}

/* The call's exit status for the exception it raised; shows it as Python shows an uncaught
 * one. The traceback starts at the call's code: no frame of the zygote is on it. */
static int report_exception(void) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    int status = 1;
    if (type == NULL) {
        return status;
    }
    if (PyErr_GivenExceptionMatches(type, PyExc_SystemExit)) {
        status = system_exit_status(value);
    } else {
        if (PyErr_GivenExceptionMatches(type, PyExc_MemoryError)) {
            (void)!write(REPORT_FD, "M", 1); /* the zygote reports the memory limit */
        }
        if (traceback != NULL) {
            PyException_SetTraceback(value, traceback);
        }
        PyErr_Display(type, value, traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return status;
}

/* Made before the first fork, so that a call allocates none of them. */
static PyObject *name_key, *main_name, *builtins_key, *builtins_module, *flush_name;

static int make_call_constants(void) {
    name_key = PyUnicode_InternFromString("__name__");
    main_name = PyUnicode_InternFromString("__main__");
    builtins_key = PyUnicode_InternFromString("__builtins__");
    flush_name = PyUnicode_InternFromString("flush");
    builtins_module = PyImport_ImportModule("builtins");
    return name_key && main_name && builtins_key && flush_name && builtins_module ? 0 : -1;
}

static void flush_stream(const char *name) {
    PyObject *stream = PySys_GetObject(name);
    PyObject *done = stream != NULL ? PyObject_CallMethodNoArgs(stream, flush_name) : NULL;
    Py_XDECREF(done);
    PyErr_Clear();
}

/* Runs the call's code as the `__main__` of a script and exits, in the forked call. In C
 * rather than in zygote.py: every Python object the call touches costs it a page fault (its
 * page is shared with the zygote), and a Python function here touched ~20 of them. */
static void __attribute__((noreturn)) run_code(const char *code) {
    int status = 0;
    PyObject *compiled = Py_CompileString(code, "<tool_call>", Py_file_input);
    PyObject *globals = compiled != NULL ? PyDict_New() : NULL;
    PyObject *result = NULL;
    if (globals != NULL && PyDict_SetItem(globals, name_key, main_name) == 0 &&
        PyDict_SetItem(globals, builtins_key, builtins_module) == 0) {
        result = PyEval_EvalCode(compiled, globals, globals);
    }
    if (result == NULL) {
        status = report_exception();
    }
    flush_stream("stdout");
    flush_stream("stderr");
    _exit(status);
}

/* -------------------------------------------------------------- cleaning up after a call */

struct kernel_dirent {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

/* The next entry of the directory open at `fd` but "." and "..", read with getdents64 into
 * `scratch` (a call never inherits it, so it never finds the names read there); `*at` and
 * `*filled` start at 0. 1: an entry, 0: the end, -1: an error. */
static int next_entry(int fd, buffer_t *scratch, size_t *at, size_t *filled,
                      struct kernel_dirent **entry) {
    for (;;) {
        if (*at >= *filled) {
            long got = syscall(SYS_getdents64, fd, scratch->data, scratch->capacity);
            if (got <= 0) {
                return got == 0 ? 0 : -1;
            }
            *at = 0;
            *filled = (size_t)got;
        }
        *entry = (struct kernel_dirent *)(scratch->data + *at);
        *at += (*entry)->d_reclen;
        const char *name = (*entry)->d_name;
        if (strcmp(name, ".") != 0 && strcmp(name, "..") != 0) {
            return 1;
        }
    }
}

static int same_file(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* The subdirectory `name` of `parent`, opened to be emptied: never through a symlink, never
 * on another filesystem than `home` (a mount), made writable (a call may have taken away
 * its own permissions; the zygote owns or may change what its calls made). */
static int enter(int parent, const char *name, const struct stat *home) {
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == EACCES && fchmodat(parent, name, 0700, 0) == 0) {
        fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    struct stat info;
    if (fd >= 0 && (fstat(fd, &info) != 0 || info.st_dev != home->st_dev || fchmod(fd, 0700))) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Removes the subdirectory of `parent` that is `child` (by its device and inode: the walk
 * below keeps no names). */
static int remove_subdirectory(int parent, const struct stat *child, buffer_t *scratch) {
    size_t at = 0, filled = 0;
    struct kernel_dirent *entry;
    int got;
    while ((got = next_entry(parent, scratch, &at, &filled, &entry)) > 0) {
        struct stat info;
        if (entry->d_type != DT_DIR && entry->d_type != DT_UNKNOWN) {
            continue;
        }
        if (fstatat(parent, entry->d_name, &info, AT_SYMLINK_NOFOLLOW) == 0 &&
            same_file(&info, child)) {
            return unlinkat(parent, entry->d_name, AT_REMOVEDIR);
        }
    }
    return -1;
}

/* Empties the directory open at `top` (left open), depth first and by file descriptor only:
 * no path is ever built, so no tree is too deep to remove, and one descriptor is open at a
 * time (a subdirectory is entered, emptied, left through "..", and removed from its parent).
 * Symlinks are removed, never followed; another filesystem (a mount) is not entered. Every
 * process of the call is gone by now, so nothing moves under the walk. Returns 0 when `top`
 * is empty, -1 at the first thing that cannot be removed. */
static int empty_tree(int top, buffer_t *scratch) {
    struct stat home;
    int current = openat(top, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* its own offset */
    if (current < 0 || fstat(top, &home) != 0) {
        goto failed;
    }
    for (;;) {
        struct stat here;
        if (fstat(current, &here) != 0) {
            goto failed;
        }
        size_t at = 0, filled = 0;
        struct kernel_dirent *entry;
        int got, entered = 0;
        while (!entered && (got = next_entry(current, scratch, &at, &filled, &entry)) > 0) {
            int is_dir = entry->d_type == DT_DIR;
            if (entry->d_type == DT_UNKNOWN) {
                struct stat info;
                if (fstatat(current, entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0) {
                    goto failed;
                }
                is_dir = S_ISDIR(info.st_mode);
            }
            if (!is_dir) {
                if (unlinkat(current, entry->d_name, 0) != 0) {
                    goto failed;
                }
            } else if (unlinkat(current, entry->d_name, AT_REMOVEDIR) != 0) {
                int child = enter(current, entry->d_name, &home);
                if (child < 0) {
                    goto failed;
                }
                close(current);
                current = child;
                entered = 1;
            }
        }
        if (entered) {
            continue;
        }
        if (got < 0) {
            goto failed;
        }
        if (same_file(&here, &home)) {
            close(current);
            return 0;
        }
        int parent = openat(current, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        close(current);
        current = parent;
        if (current < 0 || remove_subdirectory(current, &here, scratch) != 0) {
            goto failed;
        }
    }
failed:
    if (current >= 0) {
        close(current);
    }
    return -1;
}

/* Removes the directory `path` and everything in it; 0 when it is gone. */
static int remove_tree(const char *path, buffer_t *scratch) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == EACCES && chmod(path, 0700) == 0) {
        fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) {
        return errno == ENOENT ? 0 : -1;
    }
    int emptied = fchmod(fd, 0700) == 0 && empty_tree(fd, scratch) == 0;
    close(fd);
    return emptied && rmdir(path) == 0 ? 0 : -1;
}

/* Empties a private directory (/tmp, /dev/shm, ...) but what it keeps; 0 when nothing else
 * is left. */
static int empty_directory(const private_dir_t *dir, buffer_t *scratch) {
    int fd = open(dir->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat home;
    if (fd < 0 || fstat(fd, &home) != 0) {
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    int failed = 0;
    for (int restart = 1; restart && !failed;) {
        /* From the start again after each subdirectory: emptying it reused `scratch`. */
        restart = 0;
        lseek(fd, 0, SEEK_SET);
        size_t at = 0, filled = 0;
        struct kernel_dirent *entry;
        int got = 0;
        while (!restart && !failed && (got = next_entry(fd, scratch, &at, &filled, &entry)) > 0) {
            int kept = 0;
            for (int i = 0; i < dir->keep_count && !kept; i++) {
                kept = strcmp(entry->d_name, dir->keep[i]) == 0;
            }
            if (kept || unlinkat(fd, entry->d_name, 0) == 0 ||
                unlinkat(fd, entry->d_name, AT_REMOVEDIR) == 0) {
                continue;
            }
            int child = enter(fd, entry->d_name, &home);
            failed = child < 0 || empty_tree(child, scratch) != 0;
            if (child >= 0) {
                close(child);
            }
            failed = failed || unlinkat(fd, entry->d_name, AT_REMOVEDIR) != 0;
            restart = 1;
        }
        failed = failed || got < 0;
    }
    close(fd);
    return failed ? -1 : 0;
}

/* The *_STAT_ANY commands (Linux 4.17) read an object whatever its mode: a call may create
 * one the zygote has no permission to read. */
#ifndef SHM_STAT_ANY
#define SHM_STAT_ANY 15
#endif
#ifndef MSG_STAT_ANY
#define MSG_STAT_ANY 13
#endif
#ifndef SEM_STAT_ANY
#define SEM_STAT_ANY 20
#endif

/* Remove every System V shared memory segment, message queue and semaphore set: a call
 * must not find what the one before it left (they live in the executor's IPC namespace,
 * not in its files). One *_INFO call each when there are none, as after most calls.
 * Removing takes the creator's uid or CAP_SYS_ADMIN, which a root zygote no longer holds
 * (isolation.py drops it): every object here was made by a call, so a root zygote removes
 * them as the calls' uid (its effective uid alone: real and saved stay root, so no call can
 * signal or trace it meanwhile). Not root, the zygote is the calls' uid already. */
static void remove_ipc_objects(uid_t call_uid) {
    int as_calls = call_uid != 0 && geteuid() == 0;
    if (as_calls && seteuid(call_uid) != 0) {
        return;
    }
    struct shm_info shm_usage;
    int highest = shmctl(0, SHM_INFO, (struct shmid_ds *)&shm_usage);
    for (int index = 0; highest >= 0 && shm_usage.used_ids > 0 && index <= highest; index++) {
        struct shmid_ds segment;
        int id = shmctl(index, SHM_STAT_ANY, &segment);
        if (id >= 0) {
            shmctl(id, IPC_RMID, NULL);
        }
    }
    struct msginfo msg_usage;
    highest = msgctl(0, MSG_INFO, (struct msqid_ds *)&msg_usage);
    for (int index = 0; highest >= 0 && msg_usage.msgpool > 0 && index <= highest; index++) {
        struct msqid_ds queue;
        int id = msgctl(index, MSG_STAT_ANY, &queue);
        if (id >= 0) {
            msgctl(id, IPC_RMID, NULL);
        }
    }
    struct seminfo sem_usage;
    highest = semctl(0, 0, SEM_INFO, &sem_usage);
    for (int index = 0; highest >= 0 && sem_usage.semusz > 0 && index <= highest; index++) {
        struct semid_ds set;
        int id = semctl(index, 0, SEM_STAT_ANY, &set);
        if (id >= 0) {
            semctl(id, 0, IPC_RMID);
        }
    }
    if (as_calls && seteuid(0) != 0) {
        abort(); /* a zygote that cannot be root again cannot serve: the worker restarts it */
    }
}

static int has_children(void) {
    /* May reap one zombie; any child at all means leftovers. */
    return !(waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD);
}

/* Without a PID namespace: SIGKILL every direct child and its process group (orphans
 * re-parent here: subreaper), noting the first `capacity` of them in `killed`. Returns how
 * many children it found, -1 if /proc is unreadable. */
static int kill_children_of(pid_t parent, pid_t *killed, int capacity) {
    DIR *proc = opendir("/proc");
    if (proc == NULL) {
        return -1;
    }
    int found = 0;
    struct dirent *entry;
    char path[PATH_MAX], stat[512];
    while ((entry = readdir(proc)) != NULL) {
        if (entry->d_name[0] < '0' || entry->d_name[0] > '9') {
            continue;
        }
        snprintf(path, sizeof path, "/proc/%s/stat", entry->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            continue;
        }
        ssize_t got = read(fd, stat, sizeof stat - 1);
        close(fd);
        if (got <= 0) {
            continue;
        }
        stat[got] = '\0';
        char *end = strrchr(stat, ')');
        char state;
        int ppid;
        if (end != NULL && sscanf(end + 1, " %c %d", &state, &ppid) == 2 && ppid == parent) {
            pid_t pid = (pid_t)atoi(entry->d_name);
            kill_quietly(-pid);
            kill_quietly(pid);
            if (found < capacity) {
                killed[found] = pid;
            }
            found++;
        }
    }
    closedir(proc);
    return found;
}

/* Kill and reap every process a call left behind (background jobs, daemons), however deep:
 * nothing a call started outlives it. */
static void kill_leftovers(server_t *server) {
    if (!has_children()) {
        return;
    }
    if (server->kill_all) {
        kill(-1, SIGKILL); /* PID 1: every other process of the namespace, in one step */
        while (waitpid(-1, NULL, 0) >= 0 || errno == EINTR) {
        }
        return;
    }
    /* Level by level: a grandchild in a session of its own whose parent still lived is a
     * child of this subreaper once that parent is killed, and killed on the next pass; so is
     * a process forked while a pass ran. Each pass waits for the children it killed (and
     * only those: a grandchild that has just become a child is alive until the next pass
     * kills it, so waiting for any child could wait for ever), and the call's processes are
     * finite (RLIMIT_NPROC). */
    enum { TRACKED = 256 };
    pid_t killed[TRACKED];
    for (;;) {
        int found = kill_children_of(getpid(), killed, TRACKED);
        if (found < 0) { /* no /proc: wait for what the call's group kill reached */
            while (waitpid(-1, NULL, 0) >= 0 || errno == EINTR) {
            }
            return;
        }
        if (found == 0) {
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
            if (waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD) {
                return;
            }
            continue; /* a child that appeared after the pass: the next one finds it */
        }
        for (int i = 0; i < (found < TRACKED ? found : TRACKED); i++) {
            while (waitpid(killed[i], NULL, 0) < 0 && errno == EINTR) {
            }
        }
    }
}

/* One line of /proc/self/maps (name: empty for anonymous memory). */
typedef struct {
    unsigned long start, end, inode;
    char perms[8], device[16], name[256];
} mapping_t;

/* The next mapping listed in `maps`; 0 at the end. */
static int next_mapping(FILE *maps, mapping_t *mapping) {
    char line[512];
    while (fgets(line, sizeof line, maps) != NULL) {
        mapping->name[0] = '\0';
        if (sscanf(line, "%lx-%lx %7s %*s %15s %lu %255s", &mapping->start, &mapping->end,
                   mapping->perms, mapping->device, &mapping->inode, mapping->name) >= 5) {
            return 1;
        }
    }
    return 0;
}

static uintptr_t huge_page_up(uintptr_t address) {
    return (address + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
}

static uintptr_t huge_page_down(uintptr_t address) {
    return address & ~(uintptr_t)(HUGE_PAGE - 1);
}

/* Map the heap with huge pages, so that forking a call stays cheap: fork() copies one
 * page-table entry per 4 KiB page but one per 2 MiB huge page, and the call's exit unmaps as
 * many. Best effort: an older kernel says EINVAL. */
static void collapse_heap(void) {
    FILE *maps = fopen("/proc/self/maps", "re");
    if (maps == NULL) {
        return;
    }
    mapping_t mapping;
    while (next_mapping(maps, &mapping)) {
        /* Only private anonymous memory: the heap and malloc's (and Python's) mappings. */
        if (strcmp(mapping.perms, "rw-p") != 0 ||
            (mapping.name[0] != '\0' && strcmp(mapping.name, "[heap]") != 0)) {
            continue;
        }
        uintptr_t start = huge_page_up(mapping.start), end = huge_page_down(mapping.end);
        if (end > start) {
            madvise((void *)start, end - start, MADV_COLLAPSE);
        }
    }
    fclose(maps);
}

/* The run of read-only mappings of one file (its ELF headers, code and constants, mapped
 * r--p / r-xp next to each other) that holds `address`. */
static int find_read_only_span(uintptr_t address, uintptr_t *low, uintptr_t *high) {
    FILE *maps = fopen("/proc/self/maps", "re");
    if (maps == NULL) {
        return -1;
    }
    mapping_t mapping, run = {0};
    int found = 0;
    while (!found && next_mapping(maps, &mapping)) {
        const char *perms = mapping.perms;
        int read_only_file =
            mapping.inode != 0 && perms[0] == 'r' && perms[1] == '-' && perms[3] == 'p';
        if (read_only_file && mapping.start == run.end && mapping.inode == run.inode &&
            strcmp(mapping.device, run.device) == 0) {
            run.end = mapping.end; /* the run goes on */
        } else if (run.start <= address && address < run.end) {
            found = 1; /* the run that held it ended */
        } else if (read_only_file) {
            run = mapping;
        } else {
            run = (mapping_t){0};
        }
    }
    fclose(maps);
    found = found || (run.start <= address && address < run.end);
    *low = run.start, *high = run.end;
    return found ? 0 : -1;
}

/* Put the interpreter's code (libpython's, or python's own when linked statically) in huge
 * pages: an anonymous copy, collapsed to 2 MiB pages, moved over the file's mapping.
 * A call runs mostly in this code. Mapped from the file, each call faulted it in again (fork
 * copies no entries of an untouched file mapping): ~27 faults of 16 pages each, and as many
 * entries to unmap at exit. In huge pages, fork copies one entry per 2 MiB and the call never
 * faults on it. The copy is read + execute throughout (the constants between the code become
 * executable too: no loss for code that may run native code anyway) and costs each zygote its
 * size in memory; profilers that read /proc/PID/maps see it as anonymous memory. Best effort:
 * returns the bytes moved, 0 where the kernel does not allow it (no huge pages, W^X policies,
 * no 2 MiB-aligned stretch). */
static PyObject *move_code_to_huge_pages(PyObject *module, PyObject *unused) {
    (void)module, (void)unused;
    uintptr_t low, high;
    if (find_read_only_span((uintptr_t)&PyEval_EvalCode, &low, &high) != 0) {
        return PyLong_FromLong(0);
    }
    uintptr_t start = huge_page_up(low), stop = huge_page_down(high);
    if (stop <= start) {
        return PyLong_FromLong(0);
    }
    size_t size = stop - start;
    char *mapped = mmap(NULL, size + HUGE_PAGE, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) {
        return PyLong_FromLong(0);
    }
    /* Keep only a 2 MiB-aligned stretch of `size` bytes. */
    char *copy = (char *)huge_page_up((uintptr_t)mapped);
    if (copy > mapped) {
        munmap(mapped, (size_t)(copy - mapped));
    }
    munmap(copy + size, (size_t)(mapped + HUGE_PAGE - copy));
    if (madvise(copy, size, MADV_HUGEPAGE) != 0) {
        goto give_up;
    }
    memcpy(copy, (const void *)start, size);
    /* Nothing can change the code between the copy and the move: it is read-only. mremap
     * replaces the old mapping in one step, so no instruction runs from a hole. */
    if (madvise(copy, size, MADV_COLLAPSE) != 0 ||
        mprotect(copy, size, PROT_READ | PROT_EXEC) != 0 ||
        mremap(copy, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)start) == MAP_FAILED) {
        goto give_up;
    }
    return PyLong_FromSize_t(size);
give_up:
    munmap(copy, size);
    return PyLong_FromLong(0);
}

static int collapse_due(unsigned long calls) {
    return calls == 1 || calls == 4 || calls == 16 || calls % 64 == 0;
}

/* ------------------------------------------------------------------ one call, zygote side */

static int read_output(int fd, buffer_t *buffer, buffer_t *spill, size_t cap, int *truncated) {
    size_t room = cap - buffer->size;
    ssize_t got;
    if (room > 0) {
        got = read(fd, buffer->data + buffer->size, room < READ_CHUNK ? room : READ_CHUNK);
        if (got > 0) {
            buffer->size += (size_t)got;
        }
    } else {
        got = read(fd, spill->data, READ_CHUNK);
        if (got > 0) {
            *truncated = 1;
        }
    }
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) {
        return 1;
    }
    return got > 0; /* 0: end of file (or a broken pipe) */
}

/* A fresh directory at the call's path (the last call's was removed, or its zygote retired). */
static int make_workdir(server_t *server) {
    return mkdir(server->workdir, 0700);
}

/* Runs one call; returns 0, or -1 with errno set when the zygote itself failed. */
static int run_call(server_t *server, const struct request_header *request, pid_t *child) {
    const char *workdir = server->workdir;
    server->calls++;
    if (make_workdir(server) != 0) {
        return -1;
    }
    if (server->call_uid != 0 && chown(workdir, server->call_uid, server->call_uid) != 0) {
        return -1;
    }
    size_t cap = (size_t)request->output_bytes;
    if (buffer_reserve(&server->out, cap) || buffer_reserve(&server->err, cap)) {
        return -1;
    }
    server->out.size = server->err.size = 0;
    int stdin_fd = -1;
    if (request->stdin_bytes > 0) {
        stdin_fd = memfd_create("stdin", MFD_CLOEXEC);
        struct iovec part = {server->input.data, request->stdin_bytes};
        if (stdin_fd < 0 || write_all(stdin_fd, &part, 1) != 0 ||
            lseek(stdin_fd, 0, SEEK_SET) != 0) {
            return -1;
        }
    }
    int out[2], err[2], report[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(report, O_CLOEXEC)) {
        return -1;
    }
    double started = now_seconds();
    PyOS_BeforeFork();
    pid_t pid = fork();
    if (pid == 0) {
        prepare_call(server, request, stdin_fd, out[1], err[1], report[1], workdir);
        PyOS_AfterFork_Child();
        *child = 0;
        return 0;
    }
    PyOS_AfterFork_Parent();
    if (pid < 0) {
        return -1;
    }
    *child = pid;
    close(out[1]);
    close(err[1]);
    close(report[1]);
    if (stdin_fd >= 0) {
        close(stdin_fd);
    }

    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0); /* Linux 5.3+ */
    if (pidfd < 0) {
        int error = errno;
        kill_quietly(-pid);
        kill_quietly(pid);
        waitpid(pid, NULL, 0);
        errno = error;
        return -1;
    }
    /* A watched descriptor that is done is set to -1: poll() skips it. */
    int fds[3] = {out[0], err[0], pidfd};
    struct pollfd watched[3] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}, {pidfd, POLLIN, 0}};
    double deadline = started + request->timeout_seconds;
    int child_exited = 0;
    int open_pipes = 2, timed_out = 0, out_truncated = 0, err_truncated = 0;
    while (open_pipes > 0 || !child_exited) {
        double remaining = deadline - now_seconds();
        if (remaining <= 0) {
            timed_out = !child_exited; /* leftovers holding the pipes: stop listening */
            break;
        }
        int ready = poll(watched, 3, (int)(remaining * 1000.0) + 1);
        if (ready < 0 && errno == EINTR) {
            continue;
        }
        for (int i = 0; i < 3 && ready > 0; i++) {
            if (watched[i].revents == 0) {
                continue;
            }
            if (i == 2) {
                /* The call's main process is gone; leftovers holding the pipes get a
                 * short grace to flush, then are killed with the rest. */
                child_exited = 1;
                watched[2].fd = -1;
                double grace = now_seconds() + LEFTOVER_GRACE_SECONDS;
                deadline = grace < deadline ? grace : deadline;
                continue;
            }
            buffer_t *buffer = i == 0 ? &server->out : &server->err;
            int *truncated = i == 0 ? &out_truncated : &err_truncated;
            if (!read_output(watched[i].fd, buffer, &server->spill, cap, truncated)) {
                watched[i].fd = -1;
                open_pipes--;
            }
        }
        if (out_truncated || err_truncated) {
            break;
        }
    }
    if (!child_exited || timed_out || out_truncated || err_truncated) {
        kill_quietly(-pid); /* the call's process group */
        kill_quietly(pid);
    }
    int wait_status = 0;
    struct rusage usage;
    while (wait4(pid, &wait_status, 0, &usage) < 0 && errno == EINTR) {
    }
    struct answer_header answer = {0};
    answer.wait_status = wait_status;
    answer.wall_ms = (now_seconds() - started) * 1000.0;
    answer.cpu_ms = (double)(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) * 1000.0 +
                    (double)(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1000.0;
    for (int i = 0; i < 3; i++) {
        close(fds[i]);
    }
    char said[16];
    fcntl(report[0], F_SETFL, O_NONBLOCK); /* leftovers may still hold its write end */
    ssize_t report_bytes = read(report[0], said, sizeof said);
    close(report[0]);
    if (report_bytes > 0 && memchr(said, 'M', (size_t)report_bytes) != NULL) {
        answer.flags |= ANSWER_MEMORY_ERROR;
    }
    answer.flags |= (timed_out ? ANSWER_TIMED_OUT : 0) |
                    (out_truncated ? ANSWER_STDOUT_TRUNCATED : 0) |
                    (err_truncated ? ANSWER_STDERR_TRUNCATED : 0);
    answer.stdout_bytes = (uint32_t)server->out.size;
    answer.stderr_bytes = (uint32_t)server->err.size;
    struct iovec parts[3] = {
        {&answer, sizeof answer},
        {server->out.data, server->out.size},
        {server->err.data, server->err.size},
    };
    /* Nothing the call started outlives its answer; its files are removed after it. */
    kill_leftovers(server);
    int answered = write_all(server->fd, parts, 3);
    int answer_error = errno;
    /* Most calls write no files: one syscall. What cannot be removed retires the zygote
     * after this call: nothing a call left is ever handed to the next. */
    if (rmdir(workdir) != 0 && remove_tree(workdir, &server->listing) != 0) {
        server->retire = 1;
    }
    for (int i = 0; i < server->private_dir_count; i++) {
        if (empty_directory(&server->private_dirs[i], &server->listing) != 0) {
            server->retire = 1;
        }
    }
    /* Private directories mean an isolated executor, with an IPC namespace of its own;
     * without one the objects are the host's, not the call's. */
    if (server->private_dir_count > 0) {
        remove_ipc_objects(server->call_uid);
    }
    if (server->collapse && collapse_due(server->calls)) {
        collapse_heap();
    }
    errno = answer_error;
    return answered;
}

/* ---------------------------------------------------------------------------- the module */

static PyObject *serve(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    static char *keywords[] = {"fd",
                               "workdir",
                               "call_uid",
                               "kill_all",
                               "collapse",
                               "baseline_vm_bytes",
                               "max_file_bytes",
                               "max_open_files",
                               "max_processes",
                               "private_dirs",
                               NULL};
    static server_t server;
    const char *workdir;
    unsigned int call_uid;
    int kill_all, collapse;
    unsigned long long baseline;
    PyObject *private_dirs;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "isIppKLLLO!", keywords, &server.fd,
                                     &workdir, &call_uid, &kill_all, &collapse, &baseline,
                                     &server.max_file_bytes, &server.max_open_files,
                                     &server.max_processes, &PyDict_Type, &private_dirs)) {
        return NULL;
    }
    /* Not dumpable from before the first call on, for good: a process of the same uid (a
     * call, not as root) can then neither ptrace the zygote nor open its /proc/PID/mem,
     * and its /proc files belong to root. Calls inherit it (see prepare_call). */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    snprintf(server.workdir, sizeof server.workdir, "%s", workdir);
    server.call_uid = call_uid;
    server.kill_all = kill_all;
    server.collapse = collapse;
    server.baseline_vm_bytes = baseline;
    /* {path: [kept entry, ...]}: copied once, outside the Python heap. */
    server.private_dir_count = (int)PyDict_Size(private_dirs);
    server.private_dirs = PyMem_RawCalloc((size_t)server.private_dir_count + 1,
                                          sizeof(private_dir_t));
    Py_ssize_t position = 0;
    PyObject *path, *kept;
    for (int i = 0; PyDict_Next(private_dirs, &position, &path, &kept); i++) {
        private_dir_t *dir = &server.private_dirs[i];
        const char *text = PyUnicode_AsUTF8(path);
        PyObject *entries = PySequence_Fast(kept, "kept entries must be a sequence");
        if (text == NULL || entries == NULL) {
            Py_XDECREF(entries);
            return NULL;
        }
        snprintf(dir->path, sizeof dir->path, "%s", text);
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(entries) && k < MAX_KEEP; k++) {
            const char *entry = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(entries, k));
            if (entry == NULL) {
                Py_DECREF(entries);
                return NULL;
            }
            /* Kept: an entry of the directory itself, by its name there. */
            size_t length = strlen(dir->path);
            if (strncmp(entry, dir->path, length) == 0 && entry[length] == '/' &&
                entry[length + 1] != '\0' && strchr(entry + length + 1, '/') == NULL) {
                dir->keep[dir->keep_count++] = strdup(entry + length + 1);
            }
        }
        Py_DECREF(entries);
    }
    if (make_call_constants() != 0) {
        return NULL;
    }
    server.code.shared = 1; /* the call reads its code from here */
    if (buffer_reserve(&server.spill, READ_CHUNK) != 0 ||
        buffer_reserve(&server.listing, READ_CHUNK) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }

    for (;;) {
        struct request_header request;
        int got = read_exactly(server.fd, (char *)&request, sizeof request);
        if (got <= 0) {
            Py_RETURN_NONE; /* the worker went away */
        }
        if (buffer_reserve(&server.code, (size_t)request.code_bytes + 1) != 0 ||
            buffer_reserve(&server.input, (size_t)request.stdin_bytes) != 0) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (read_exactly(server.fd, server.code.data, request.code_bytes) <= 0 ||
            read_exactly(server.fd, server.input.data, request.stdin_bytes) <= 0) {
            Py_RETURN_NONE; /* the worker went away mid-request */
        }
        server.code.size = request.code_bytes;
        server.code.data[request.code_bytes] = '\0'; /* the worker sends no NUL in code */
        pid_t child = -1;
        if (run_call(&server, &request, &child) != 0) {
            if (child == 0) {
                _exit(1);
            }
            if (errno == EPIPE || errno == ECONNRESET) {
                Py_RETURN_NONE; /* the worker went away before the answer */
            }
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (child == 0) {
            run_code(server.code.data);
        }
        /* The next call inherits this buffer (it reads its code from it): nothing of this
         * call's code may be left in it. */
        memset(server.code.data, 0, server.code.size + 1);
        server.code.size = 0;
        if (server.retire) {
            Py_RETURN_NONE; /* the worker starts another zygote in its place */
        }
    }
}

static PyMethodDef methods[] = {
    {"move_code_to_huge_pages", move_code_to_huge_pages, METH_NOARGS,
     "Map the interpreter's code from huge pages (see _forkserver.c); returns the bytes moved."},
    {"serve", (PyCFunction)(void (*)(void))serve, METH_VARARGS | METH_KEYWORDS,
     "Serve calls on the control socket until the worker closes it (each call runs in a "
     "forked process that never returns here)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_forkserver",
    .m_doc = "The zygote's serving loop (see _forkserver.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__forkserver(void) {
    PyObject *module = PyModule_Create(&definition);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "ANSWER_TIMED_OUT", ANSWER_TIMED_OUT) ||
        PyModule_AddIntConstant(module, "ANSWER_STDOUT_TRUNCATED", ANSWER_STDOUT_TRUNCATED) ||
        PyModule_AddIntConstant(module, "ANSWER_STDERR_TRUNCATED", ANSWER_STDERR_TRUNCATED) ||
        PyModule_AddIntConstant(module, "ANSWER_MEMORY_ERROR", ANSWER_MEMORY_ERROR)) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
