/*
 * slurm_fiber_cgroup: a SPANK plugin that hands the task cgroup of a step running
 * fiberd-run to the job's user, the way the kernel's cgroup v2 delegation rules describe
 * (Documentation/admin-guide/cgroup-v2.rst, "Delegation"), so that the job user's fiberd
 * can give every fiber a cgroup of its own below it.
 *
 * What it does, and only for a step whose command (argv[0], its last path component) is
 * one of the plugin's commands (default: fiberd-run; plugstack.conf `command=NAME`,
 * repeatable), in slurmstepd, as root, from slurm_spank_task_post_fork (after Slurm put
 * the task in its cgroups, before the task runs anything):
 *
 *   cgroup v2: the task's cgroup (its /proc/<pid>/cgroup `0::` line), only when that path
 *     ends in step_<this step>/user/task_<k>: the directory and its cgroup.procs,
 *     cgroup.threads and cgroup.subtree_control are chowned to the job's uid and gid;
 *     cgroup.max.depth and cgroup.max.descendants are lowered to the plugin's caps
 *     (max_depth=, max_descendants=) and stay root's, as do every resource file
 *     (memory.max, pids.max, cpu.max, ...) and the directories above.
 *   cgroup v1 (Slurm 23.02+ makes every group root's): each v1 group the task is in whose
 *     path ends in job_<this job>/step_<this step> or .../step_<this step>/task_<k>: the
 *     directory alone is chowned to the job's uid and gid, which is what Slurm up to 22.05
 *     did itself (its cgroup.procs, tasks and every other file stay root's: the user makes
 *     groups below it, whose files are the user's, and moves its own processes there).
 *
 * What the user gets: the right to make cgroups below that directory (up to the caps on
 * v2), to move its own processes between that directory (v2) and what it made there, and to
 * set the limits of what it made there, which the kernel keeps within the limits above.
 * What it does not get: any file of a directory above, any resource file of the
 * delegated directory, a move across the step's or the job's boundary (v2 needs write
 * access to the common ancestor's cgroup.procs, root's), or any group of another step.
 *
 * Every refusal or failure is logged (slurmd's log, and the step's stderr) and leaves
 * the step running as Slurm made it: fiberd then runs uncarved and says why. Nothing is
 * followed through a symbolic link; paths are checked to hold the task's pid before
 * anything is changed. Built per Slurm release against that release's slurm/spank.h
 * (Makefile): Slurm loads only plugins built for its own version.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(slurm_fiber_cgroup, 1);

#define MAX_COMMANDS 8
#define DEFAULT_MAX_DEPTH 8
#define DEFAULT_MAX_DESCENDANTS 16384
#define LINE_MAX_LEN 4096

struct config {
	const char *commands[MAX_COMMANDS];
	int ncommands;
	long max_depth;
	long max_descendants;
};

static int parse_config(int ac, char **av, struct config *conf)
{
	conf->ncommands = 0;
	conf->max_depth = DEFAULT_MAX_DEPTH;
	conf->max_descendants = DEFAULT_MAX_DESCENDANTS;
	for (int i = 0; i < ac; i++) {
		char *end = NULL;
		if (!strncmp(av[i], "command=", 8) && av[i][8] && !strchr(av[i] + 8, '/')) {
			if (conf->ncommands == MAX_COMMANDS) {
				slurm_error("slurm_fiber_cgroup: more than %d command= arguments",
					    MAX_COMMANDS);
				return -1;
			}
			conf->commands[conf->ncommands++] = av[i] + 8;
		} else if (!strncmp(av[i], "max_depth=", 10)) {
			conf->max_depth = strtol(av[i] + 10, &end, 10);
			if (*end || conf->max_depth < 1 || conf->max_depth > 64) {
				slurm_error("slurm_fiber_cgroup: max_depth= must be 1..64");
				return -1;
			}
		} else if (!strncmp(av[i], "max_descendants=", 16)) {
			conf->max_descendants = strtol(av[i] + 16, &end, 10);
			if (*end || conf->max_descendants < 1 || conf->max_descendants > 1000000) {
				slurm_error("slurm_fiber_cgroup: max_descendants= must be 1..1000000");
				return -1;
			}
		} else {
			slurm_error("slurm_fiber_cgroup: unknown argument %s (command=NAME, "
				    "max_depth=N, max_descendants=N)", av[i]);
			return -1;
		}
	}
	if (conf->ncommands == 0)
		conf->commands[conf->ncommands++] = "fiberd-run";
	return 0;
}

/* Checks the arguments once, where Slurm loads the plugin: a bad plugstack.conf line
 * fails there, loudly, rather than in every step. */
int slurm_spank_init(spank_t sp, int ac, char **av)
{
	struct config conf;
	(void)sp;
	return parse_config(ac, av, &conf) ? ESPANK_BAD_ARG : ESPANK_SUCCESS;
}

static int is_fiberd_step(spank_t sp, const struct config *conf)
{
	int argc = 0;
	char **argv = NULL;
	if (spank_get_item(sp, S_JOB_ARGV, &argc, &argv) != ESPANK_SUCCESS || argc < 1 ||
	    !argv || !argv[0])
		return 0;
	const char *base = strrchr(argv[0], '/');
	base = base ? base + 1 : argv[0];
	for (int i = 0; i < conf->ncommands; i++)
		if (!strcmp(base, conf->commands[i]))
			return 1;
	return 0;
}

/* Whether `name` is `prefix` followed by one or more digits and nothing else. */
static int numbered(const char *name, size_t len, const char *prefix)
{
	size_t p = strlen(prefix);
	if (len <= p || strncmp(name, prefix, p))
		return 0;
	for (size_t i = p; i < len; i++)
		if (name[i] < '0' || name[i] > '9')
			return 0;
	return 1;
}

/* The last `n` components of `path` (up to 4), split in place into `parts`; how many. */
static int last_components(const char *path, const char *parts[4], size_t lens[4], int n)
{
	const char *end = path + strlen(path);
	int got = 0;
	while (got < n && end > path) {
		const char *start = end;
		while (start > path && start[-1] != '/')
			start--;
		parts[n - 1 - got] = start;
		lens[n - 1 - got] = (size_t)(end - start);
		got++;
		end = start > path ? start - 1 : path;
	}
	return got;
}

static int is_named(const char *part, size_t len, const char *name)
{
	return strlen(name) == len && !strncmp(part, name, len);
}

/* v2: .../step_<step>/user/task_<k> */
static int v2_task_path(const char *path, uint32_t step)
{
	const char *parts[4];
	size_t lens[4];
	char want[32];
	if (last_components(path, parts, lens, 3) != 3)
		return 0;
	snprintf(want, sizeof(want), "step_%" PRIu32, step);
	return is_named(parts[0], lens[0], want) && is_named(parts[1], lens[1], "user") &&
	       numbered(parts[2], lens[2], "task_");
}

/* v1: .../job_<job>/step_<step> or .../job_<job>/step_<step>/task_<k> */
static int v1_step_path(const char *path, uint32_t job, uint32_t step)
{
	const char *parts[4];
	size_t lens[4];
	char want_job[32], want_step[32];
	int got = last_components(path, parts, lens, 3);
	snprintf(want_job, sizeof(want_job), "job_%" PRIu32, job);
	snprintf(want_step, sizeof(want_step), "step_%" PRIu32, step);
	if (got == 3 && is_named(parts[0], lens[0], want_job) &&
	    is_named(parts[1], lens[1], want_step) && numbered(parts[2], lens[2], "task_"))
		return 1;
	return got >= 2 && is_named(parts[got - 2], lens[got - 2], want_job) &&
	       is_named(parts[got - 1], lens[got - 1], want_step);
}

/* The mount point of the cgroup2 file system (`controller` NULL) or of the v1 hierarchy
 * carrying `controller` ("freezer", "cpu,cpuacct"), from /proc/self/mountinfo. */
static int mount_point(const char *controller, char *out, size_t outlen)
{
	FILE *f = fopen("/proc/self/mountinfo", "re");
	char line[LINE_MAX_LEN];
	int found = 0;
	if (!f)
		return 0;
	while (!found && fgets(line, sizeof(line), f)) {
		char *sep = strstr(line, " - ");
		char mnt[PATH_MAX], fstype[64], source[256], options[1024];
		if (!sep || sscanf(line, "%*s %*s %*s %*s %4095s", mnt) != 1)
			continue;
		if (sscanf(sep + 3, "%63s %255s %1023s", fstype, source, options) != 3)
			continue;
		if (!controller) {
			found = !strcmp(fstype, "cgroup2");
		} else if (!strcmp(fstype, "cgroup")) {
			/* every controller of `controller` is among the super options */
			char want[256];
			snprintf(want, sizeof(want), "%s", controller);
			found = 1;
			for (char *save = NULL, *c = strtok_r(want, ",", &save); c;
			     c = strtok_r(NULL, ",", &save)) {
				char padded_opts[1100], padded[80];
				snprintf(padded_opts, sizeof(padded_opts), ",%s,", options);
				snprintf(padded, sizeof(padded), ",%s,", c);
				if (!strstr(padded_opts, padded))
					found = 0;
			}
		}
		if (found && strchr(mnt, '\\'))
			found = 0; /* an escaped name (a space): not a place Slurm uses */
		if (found)
			snprintf(out, outlen, "%s", mnt);
	}
	fclose(f);
	return found;
}

/* Whether the group open at `dirfd` lists `pid` in its cgroup.procs. */
static int holds_pid(int dirfd, pid_t pid)
{
	int fd = openat(dirfd, "cgroup.procs", O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	FILE *f;
	long listed;
	int found = 0;
	if (fd < 0)
		return 0;
	f = fdopen(fd, "r");
	if (!f) {
		close(fd);
		return 0;
	}
	while (!found && fscanf(f, "%ld", &listed) == 1)
		found = (listed == (long)pid);
	fclose(f);
	return found;
}

/* Lower the cap in `file` (a v2 cgroup.max.* file, root's) to `cap`, never raise it. */
static int cap_file(int dirfd, const char *file, long cap, const char *where)
{
	char buf[64] = "";
	char *end = NULL;
	ssize_t n;
	int fd = openat(dirfd, file, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0) {
		slurm_error("slurm_fiber_cgroup: %s/%s: %m", where, file);
		return -1;
	}
	n = read(fd, buf, sizeof(buf) - 1);
	if (n > 0) {
		long now;
		buf[n] = '\0';
		now = strtol(buf, &end, 10);
		if (end != buf && (*end == '\n' || *end == '\0') && now <= cap) {
			close(fd);
			return 0;
		}
	}
	snprintf(buf, sizeof(buf), "%ld\n", cap);
	if (pwrite(fd, buf, strlen(buf), 0) < 0) {
		slurm_error("slurm_fiber_cgroup: cannot write %ld to %s/%s: %m", cap, where, file);
		close(fd);
		return -1;
	}
	close(fd);
	return 0;
}

static int give(int dirfd, const char *file, uid_t uid, gid_t gid, const char *where)
{
	if (fchownat(dirfd, file, uid, gid, AT_SYMLINK_NOFOLLOW | (*file ? 0 : AT_EMPTY_PATH))) {
		slurm_error("slurm_fiber_cgroup: cannot chown %s/%s to %u:%u: %m", where, file,
			    (unsigned)uid, (unsigned)gid);
		return -1;
	}
	return 0;
}

/* Hand the group `mnt`/`rel` to uid:gid: on v2 with the caps, on v1 as Slurm 22.05 did. */
static int delegate(const char *mnt, const char *rel, int v2, pid_t pid, uid_t uid,
		    gid_t gid, const struct config *conf)
{
	static const char *const v2_files[] = {"cgroup.procs", "cgroup.threads",
					       "cgroup.subtree_control", NULL};
	static const char *const v1_files[] = {NULL};
	const char *const *files = v2 ? v2_files : v1_files;
	char where[PATH_MAX];
	int dirfd, rc = 0;
	if (snprintf(where, sizeof(where), "%s%s", mnt, rel) >= (int)sizeof(where) ||
	    strstr(rel, "/../") || strstr(rel, "/./")) {
		slurm_error("slurm_fiber_cgroup: cgroup path %s%s refused", mnt, rel);
		return -1;
	}
	dirfd = open(where, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
	if (dirfd < 0) {
		slurm_error("slurm_fiber_cgroup: cannot open %s: %m", where);
		return -1;
	}
	if (!holds_pid(dirfd, pid)) {
		slurm_error("slurm_fiber_cgroup: %s does not hold task %d: not delegated", where,
			    (int)pid);
		close(dirfd);
		return -1;
	}
	if (v2 && (cap_file(dirfd, "cgroup.max.depth", conf->max_depth, where) ||
		   cap_file(dirfd, "cgroup.max.descendants", conf->max_descendants, where))) {
		close(dirfd);
		return -1; /* no cap, no delegation */
	}
	for (int i = 0; files[i]; i++)
		rc |= give(dirfd, files[i], uid, gid, where);
	if (!rc)
		rc = give(dirfd, "", uid, gid, where); /* the directory last: all or nothing usable */
	close(dirfd);
	if (!rc)
		slurm_info("slurm_fiber_cgroup: delegated %s to uid %u (%s)", where, (unsigned)uid,
			   v2 ? "cgroup v2" : "cgroup v1");
	return rc;
}

int slurm_spank_task_post_fork(spank_t sp, int ac, char **av)
{
	struct config conf;
	uint32_t job = 0, step = 0;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	char path[64], line[LINE_MAX_LEN], mnt[PATH_MAX];
	FILE *f;
	int delegated = 0;

	if (!spank_remote(sp) || parse_config(ac, av, &conf) || !is_fiberd_step(sp, &conf))
		return ESPANK_SUCCESS;
	if (spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &gid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_ID, &job) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_TASK_PID, &pid) != ESPANK_SUCCESS) {
		slurm_error("slurm_fiber_cgroup: the step's ids are unavailable: not delegated");
		return ESPANK_SUCCESS;
	}
	if (uid == 0)
		return ESPANK_SUCCESS; /* root's task cgroup is root's already */
	snprintf(path, sizeof(path), "/proc/%d/cgroup", (int)pid);
	f = fopen(path, "re");
	if (!f) {
		slurm_error("slurm_fiber_cgroup: %s: %m", path);
		return ESPANK_SUCCESS;
	}
	while (fgets(line, sizeof(line), f)) {
		char *controllers, *rel, *nl;
		controllers = strchr(line, ':');
		rel = controllers ? strchr(controllers + 1, ':') : NULL;
		if (!rel)
			continue;
		*controllers++ = '\0';
		*rel++ = '\0';
		if ((nl = strchr(rel, '\n')))
			*nl = '\0';
		if (!strcmp(line, "0") && !*controllers) { /* the cgroup v2 line */
			if (v2_task_path(rel, step) && mount_point(NULL, mnt, sizeof(mnt)))
				delegated += !delegate(mnt, rel, 1, pid, uid, gid, &conf);
		} else if (*controllers && strncmp(controllers, "name=", 5)) {
			struct stat st;
			char where[PATH_MAX];
			if (!v1_step_path(rel, job, step) || !mount_point(controllers, mnt, sizeof(mnt)))
				continue;
			snprintf(where, sizeof(where), "%s%s", mnt, rel);
			if (!stat(where, &st) && st.st_uid == uid)
				continue; /* Slurm up to 22.05 gave it already */
			delegated += !delegate(mnt, rel, 0, pid, uid, gid, &conf);
		}
	}
	fclose(f);
	if (!delegated)
		slurm_debug("slurm_fiber_cgroup: nothing delegated for %u.%u task pid %d", job, step,
			    (int)pid);
	return ESPANK_SUCCESS;
}
