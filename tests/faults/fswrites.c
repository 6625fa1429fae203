/* The file writes of a study, seen from inside every process of it (the driver, Ray's and Tune's, a trial's
 * workers), for tests/test_kill_anywhere.py and scripts/observe_writes.py. Loaded with LD_PRELOAD, it wraps the C
 * library's calls that change a folder's contents: open/openat/creat for writing, rename/renameat/renameat2,
 * unlink/unlinkat, mkdir/mkdirat and rmdir. Python's own file calls and pyarrow's C++ ones (Tune's experiment state,
 * tuner.pkl) both go through them, which a Python-level hook (tests/faults/sitecustomize.py) cannot see.
 *
 * Only paths below A2_FS_ROOT count (an absolute folder: the study's storage). Nothing else is read or written:
 * without A2_FS_ROOT every call goes straight to the C library.
 *
 * - A2_FS_LOG=FILE: after each successful write below the root, one line is appended to FILE:
 *   "<pid>\t<driver|process title>\t<op>\t<path relative to the root>[\t<new path>]" (op: write, rename, delete,
 *   mkdir, rmdir; rename's line names both paths). One write(2) a line on an O_APPEND file: lines of processes
 *   writing at once do not mix.
 * - A2_FS_KILL="TARGET OP GLOB[@N];...": kill windows, each armed once. Right before the N-th (default 1) call of
 *   this process whose op is OP and whose path (a rename's new path) relative to the root matches GLOB (fnmatch(3),
 *   `*` crosses `/`), the process SIGKILLs TARGET: `driver` (the study's driver: the process this library was first
 *   loaded into, whose pid its children inherit in A2_FS_DRIVER_PID) or `self` (a trial's worker killing itself).
 *   The call is not made: the kill falls between the write before it and this one. A window fires once in all of
 *   the study's processes: its marker, a file in the folder A2_FS_FIRED made with O_EXCL, says which process fired
 *   it at what path. The first window listed that matches a call wins. A process that killed the driver then waits
 *   to be killed with the rest, doing nothing more.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static const char *root;     /* A2_FS_ROOT, without a trailing '/' */
static size_t root_len;
static const char *log_path; /* A2_FS_LOG */
#define MAX_WINDOWS 64
static struct window {        /* A2_FS_KILL's entries */
    char op[16];
    char glob[512];
    long nth;                 /* the N-th matching call of this process */
    int self;                 /* kill this process, not the driver */
    long seen;                /* matching calls of this process so far */
    char marker[PATH_MAX];    /* A2_FS_FIRED/<entry>: made when it fires */
} windows[MAX_WINDOWS];
static int n_windows;
static pid_t driver_pid;

#define REAL(name) static __typeof__(name) *real_##name; if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

__attribute__((constructor)) static void init(void) {
    root = getenv("A2_FS_ROOT");
    if (root == NULL || root[0] != '/') {
        root = NULL;
        return;
    }
    root_len = strlen(root);
    while (root_len > 1 && root[root_len - 1] == '/') root_len--;
    log_path = getenv("A2_FS_LOG");
    const char *driver = getenv("A2_FS_DRIVER_PID");
    if (driver == NULL || *driver == '\0') {  /* the first process: the driver; its children learn its pid */
        char pid[32];
        snprintf(pid, sizeof pid, "%d", (int)getpid());
        setenv("A2_FS_DRIVER_PID", pid, 1);
        driver_pid = getpid();
    } else {
        driver_pid = (pid_t)atol(driver);
    }
    const char *spec = getenv("A2_FS_KILL"), *fired = getenv("A2_FS_FIRED");
    while (spec != NULL && *spec != '\0' && n_windows < MAX_WINDOWS) {
        const char *end = strchr(spec, ';');
        size_t len = end ? (size_t)(end - spec) : strlen(spec);
        char entry[600];
        if (len > 0 && len < sizeof entry) {
            memcpy(entry, spec, len);
            entry[len] = '\0';
            struct window *w = &windows[n_windows];
            char target[16];
            if (sscanf(entry, "%15s %15s %511[^\n]", target, w->op, w->glob) == 3) {
                w->nth = 1;
                char *at = strrchr(w->glob, '@');
                if (at != NULL && at[1] >= '1' && at[1] <= '9') {
                    w->nth = atol(at + 1);
                    *at = '\0';
                }
                w->self = strcmp(target, "self") == 0;
                char name[600];
                size_t k = 0;
                for (const char *c = entry; *c && k < sizeof name - 1; c++)  /* the entry as one file name */
                    name[k++] = (*c == '/' || *c == ' ' || *c == '*') ? '_' : *c;
                name[k] = '\0';
                snprintf(w->marker, sizeof w->marker, "%s/%s", fired ? fired : "/tmp", name);
                n_windows++;
            }
        }
        spec = end ? end + 1 : NULL;
    }
}

/* `path` (relative to `dirfd`) as an absolute path in `out`; 0 when it is not below the root. */
static int below_root(int dirfd, const char *path, char *out, size_t size) {
    if (root == NULL || path == NULL) return 0;
    if (path[0] == '/') {
        snprintf(out, size, "%s", path);
    } else {
        char base[PATH_MAX];
        if (dirfd == AT_FDCWD) {
            if (getcwd(base, sizeof base) == NULL) return 0;
        } else {
            char link[64];
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t n = readlink(link, base, sizeof base - 1);
            if (n < 0) return 0;
            base[n] = '\0';
        }
        snprintf(out, size, "%s/%s", base, path);
    }
    return strncmp(out, root, root_len) == 0 && (out[root_len] == '/' || out[root_len] == '\0');
}

static const char *relative(const char *absolute) {
    return absolute[root_len] == '/' ? absolute + root_len + 1 : absolute + root_len;
}

static void title(char *out, size_t size) {
    if (getpid() == driver_pid) {
        snprintf(out, size, "driver");
        return;
    }
    REAL(open);
    int fd = real_open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, out, size - 1);
    if (fd >= 0) close(fd);
    if (n <= 0) n = snprintf(out, size, "?");
    out[n < (ssize_t)size ? n : (ssize_t)size - 1] = '\0';  /* the first argument: Ray's process title */
    for (char *c = out; *c; c++)
        if (*c == '\t' || *c == '\n') *c = ' ';
}

static void record(const char *op, const char *path, const char *to) {
    if (log_path == NULL) return;
    char line[3 * PATH_MAX], who[256];
    title(who, sizeof who);
    int n = snprintf(line, sizeof line, "%d\t%s\t%s\t%s%s%s\n", (int)getpid(), who, op, relative(path),
                     to ? "\t" : "", to ? relative(to) : "");
    REAL(open);
    int fd = real_open(log_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    ssize_t written = write(fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1));
    (void)written;
    close(fd);
}

/* Before a write of `op` at `path` (absolute, below the root): the kill, when this is a call A2_FS_KILL names. */
static void maybe_kill(const char *op, const char *path) {
    if (n_windows == 0) return;
    int there = -1;
    for (int i = 0; i < n_windows; i++) {
        struct window *w = &windows[i];
        if (strcmp(op, w->op) != 0 || fnmatch(w->glob, relative(path), 0) != 0) continue;
        if (there < 0) there = access(path, F_OK) == 0;
        /* a call that changes nothing (a folder made twice, a file deleted twice) is no write */
        if ((strcmp(op, "mkdir") == 0 && there) || ((strcmp(op, "delete") == 0 || strcmp(op, "rmdir") == 0) && !there))
            return;
        if (__atomic_add_fetch(&w->seen, 1, __ATOMIC_SEQ_CST) != w->nth) continue;
        REAL(open);
        int fd = real_open(w->marker, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) continue;  /* fired already, in this process or another */
        char line[PATH_MAX + 128], who[256];
        title(who, sizeof who);
        int n = snprintf(line, sizeof line, "%d\t%s\t%s\t%s\n", (int)getpid(), who, op, relative(path));
        ssize_t written = write(fd, line, (size_t)(n < (int)sizeof line ? n : (int)sizeof line - 1));
        (void)written;
        close(fd);
        kill(w->self ? getpid() : driver_pid, SIGKILL);
        for (;;) pause();  /* not the driver: killed with the study's other processes; nothing after the point runs */
    }
}

static int writes(int flags) { return (flags & (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC)) != 0; }

static int opened(int dirfd, const char *path, int flags, mode_t mode, int at) {
    char full[PATH_MAX];
    int watched = writes(flags) && below_root(dirfd, path, full, sizeof full);
    if (watched) maybe_kill("write", full);
    int fd;
    if (at) {
        REAL(openat);
        fd = real_openat(dirfd, path, flags, mode);
    } else {
        REAL(open);
        fd = real_open(path, flags, mode);
    }
    if (watched && fd >= 0) {
        int saved = errno;
        record("write", full, NULL);
        errno = saved;
    }
    return fd;
}

static mode_t mode_of(int flags, va_list args) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(args, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list args;
    va_start(args, flags);
    mode_t mode = mode_of(flags, args);
    va_end(args);
    return opened(AT_FDCWD, path, flags, mode, 0);
}

int open64(const char *path, int flags, ...) {
    va_list args;
    va_start(args, flags);
    mode_t mode = mode_of(flags, args);
    va_end(args);
    return opened(AT_FDCWD, path, flags, mode, 0);
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list args;
    va_start(args, flags);
    mode_t mode = mode_of(flags, args);
    va_end(args);
    return opened(dirfd, path, flags, mode, 1);
}

int openat64(int dirfd, const char *path, int flags, ...) {
    va_list args;
    va_start(args, flags);
    mode_t mode = mode_of(flags, args);
    va_end(args);
    return opened(dirfd, path, flags, mode, 1);
}

int creat(const char *path, mode_t mode) { return opened(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 0); }

int creat64(const char *path, mode_t mode) { return opened(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 0); }

static int renamed(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned flags, int kind) {
    char from[PATH_MAX], to[PATH_MAX];
    int src = below_root(olddirfd, oldpath, from, sizeof from);
    int dst = below_root(newdirfd, newpath, to, sizeof to);
    if (dst) maybe_kill("rename", to);
    int rc;
    if (kind == 0) {
        REAL(rename);
        rc = real_rename(oldpath, newpath);
    } else if (kind == 1) {
        REAL(renameat);
        rc = real_renameat(olddirfd, oldpath, newdirfd, newpath);
    } else {
        REAL(renameat2);
        rc = real_renameat2(olddirfd, oldpath, newdirfd, newpath, flags);
    }
    if (rc == 0 && (src || dst)) {
        int saved = errno;
        if (dst) record("rename", src ? from : to, to);
        else record("delete", from, NULL);  /* moved out of the study */
        errno = saved;
    }
    return rc;
}

int rename(const char *oldpath, const char *newpath) { return renamed(AT_FDCWD, oldpath, AT_FDCWD, newpath, 0, 0); }

int renameat(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    return renamed(olddirfd, oldpath, newdirfd, newpath, 0, 1);
}

int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned flags) {
    return renamed(olddirfd, oldpath, newdirfd, newpath, flags, 2);
}

/* unlink, rmdir, mkdir and their *at forms: op, then the call. */
static int changed(const char *op, int dirfd, const char *path, int (*call)(void *), void *args) {
    char full[PATH_MAX];
    int watched = below_root(dirfd, path, full, sizeof full);
    if (watched) maybe_kill(op, full);
    int rc = call(args);
    if (watched && rc == 0) {
        int saved = errno;
        record(op, full, NULL);
        errno = saved;
    }
    return rc;
}

struct call { int dirfd; const char *path; int flags; mode_t mode; };

static int do_unlink(void *a) { REAL(unlink); return real_unlink(((struct call *)a)->path); }
static int do_unlinkat(void *a) {
    struct call *c = a;
    REAL(unlinkat);
    return real_unlinkat(c->dirfd, c->path, c->flags);
}
static int do_rmdir(void *a) { REAL(rmdir); return real_rmdir(((struct call *)a)->path); }
static int do_mkdir(void *a) { REAL(mkdir); return real_mkdir(((struct call *)a)->path, ((struct call *)a)->mode); }
static int do_mkdirat(void *a) {
    struct call *c = a;
    REAL(mkdirat);
    return real_mkdirat(c->dirfd, c->path, c->mode);
}

int unlink(const char *path) {
    struct call c = {AT_FDCWD, path, 0, 0};
    return changed("delete", AT_FDCWD, path, do_unlink, &c);
}

int unlinkat(int dirfd, const char *path, int flags) {
    struct call c = {dirfd, path, flags, 0};
    return changed(flags & AT_REMOVEDIR ? "rmdir" : "delete", dirfd, path, do_unlinkat, &c);
}

int rmdir(const char *path) {
    struct call c = {AT_FDCWD, path, 0, 0};
    return changed("rmdir", AT_FDCWD, path, do_rmdir, &c);
}

int mkdir(const char *path, mode_t mode) {
    struct call c = {AT_FDCWD, path, 0, mode};
    return changed("mkdir", AT_FDCWD, path, do_mkdir, &c);
}

int mkdirat(int dirfd, const char *path, mode_t mode) {
    struct call c = {dirfd, path, 0, mode};
    return changed("mkdir", dirfd, path, do_mkdirat, &c);
}
