/*
 * cgroup2-view: preloaded into slurmd (and so into its slurmstepds) by entrypoint.sh when
 * the container cluster runs Slurm's cgroup/v2 plugin (`cluster up --slurm-cgroup v2`).
 *
 * Why: the test hosts are hybrid (cgroup v1 controllers, plus a cgroup2 hierarchy with no
 * controllers), and a process's /proc/<pid>/cgroup lists every hierarchy, v1 lines first.
 * Slurm's cgroup/v2 plugin reads that file to find its own cgroup and stops at the first
 * v1 line ("Hybrid mode is not supported", cgroup_v2.c _get_proc_cg_path), although it
 * only ever works in the cgroup2 tree. This library shows slurmd and slurmstepd that file
 * as a pure cgroup v2 host would: its "0::" line alone. Nothing else changes: the
 * plugin makes, fills and removes real cgroup2 directories, and the job's own processes
 * (which do not inherit it) see the real file.
 *
 * Built by `cluster up` on the host (gcc -shared -fPIC) and bind-mounted read-only into
 * the node containers. Interposes open/open64/openat/openat64 (and the fortified
 * __open_2/__open64_2), read-only opens of /proc/{self,thread-self,<pid>}[/task/<tid>]/cgroup
 * only; any failure falls back to the real file.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*open_fn)(const char *, int, ...);
typedef int (*openat_fn)(int, const char *, int, ...);

static const char *skip_id(const char *p)
{
	if (!isdigit((unsigned char) *p))
		return NULL;
	while (isdigit((unsigned char) *p))
		p++;
	return *p == '/' ? p + 1 : NULL;
}

static int is_proc_cgroup(const char *path)
{
	const char *p;

	if (!path || strncmp(path, "/proc/", 6))
		return 0;
	p = path + 6;
	if (!strncmp(p, "self/", 5))
		p += 5;
	else if (!strncmp(p, "thread-self/", 12))
		p += 12;
	else if (!(p = skip_id(p)))
		return 0;
	if (!strncmp(p, "task/", 5) && !(p = skip_id(p + 5)))
		return 0;
	return !strcmp(p, "cgroup");
}

/* A memfd holding the "0::" line of the open cgroup file fd; fd itself when that fails. */
static int v2_only(int fd, int flags)
{
	char buf[65536], *line, *end;
	size_t len = 0;
	ssize_t got;
	int out, saved = errno;

	while (len < sizeof(buf) - 1) {
		got = pread(fd, buf + len, sizeof(buf) - 1 - len, len);
		if (got < 0 && errno == EINTR)
			continue;
		if (got <= 0)
			break;
		len += got;
	}
	buf[len] = '\0';
	out = memfd_create("cgroup2-view", (flags & O_CLOEXEC) ? MFD_CLOEXEC : 0);
	if (out < 0) {
		errno = saved;
		return fd;
	}
	for (line = buf; line < buf + len; line = end + 1) {
		end = strchr(line, '\n');
		if (!end)
			end = buf + len;
		if (!strncmp(line, "0::", 3) &&
		    write(out, line, end - line + (end < buf + len)) < 0) {
			close(out);
			errno = saved;
			return fd;
		}
	}
	lseek(out, 0, SEEK_SET);
	close(fd);
	errno = saved;
	return out;
}

static mode_t mode_arg(int flags, va_list ap)
{
	return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;
}

static int filtered(int fd, const char *path, int flags)
{
	if (fd >= 0 && (flags & O_ACCMODE) == O_RDONLY && is_proc_cgroup(path))
		return v2_only(fd, flags);
	return fd;
}

#define OPEN(name)                                                       \
	int name(const char *path, int flags, ...)                       \
	{                                                                \
		static open_fn real;                                     \
		va_list ap;                                              \
		mode_t mode;                                             \
		if (!real)                                               \
			real = (open_fn) dlsym(RTLD_NEXT, #name);        \
		va_start(ap, flags);                                     \
		mode = mode_arg(flags, ap);                              \
		va_end(ap);                                              \
		return filtered(real(path, flags, mode), path, flags);   \
	}

#define OPENAT(name)                                                      \
	int name(int dirfd, const char *path, int flags, ...)             \
	{                                                                 \
		static openat_fn real;                                    \
		va_list ap;                                               \
		mode_t mode;                                              \
		if (!real)                                                \
			real = (openat_fn) dlsym(RTLD_NEXT, #name);       \
		va_start(ap, flags);                                      \
		mode = mode_arg(flags, ap);                               \
		va_end(ap);                                               \
		return filtered(real(dirfd, path, flags, mode), path,     \
				flags);                                   \
	}

#define OPEN_2(name)                                                     \
	int name(const char *path, int flags)                            \
	{                                                                \
		static int (*real)(const char *, int);                   \
		if (!real)                                               \
			real = (int (*)(const char *, int))              \
				dlsym(RTLD_NEXT, #name);                 \
		return filtered(real(path, flags), path, flags);         \
	}

OPEN(open)
OPEN(open64)
OPENAT(openat)
OPENAT(openat64)
OPEN_2(__open_2)
OPEN_2(__open64_2)
