/* Native backtrace on SIGSEGV/SIGBUS/SIGABRT, for an abort of the one-process GPU tier.
 * Build: gcc -shared -fPIC -O1 -o /tmp/segv_handler.so segv_handler.c -ldl
 * Loaded by tools/diag/pytest_diag.py (CGRAW_DIAG_SEGV=path), which calls segv_install() at
 * the start of every test: something in the process replaces a handler installed once, and
 * pytest captures file descriptor 2 during a test, so the trace goes to CGRAW_DIAG_NATIVE_OUT.
 * After printing, the previous handler (Python's faulthandler) runs, then the default action
 * (a core file where the core limit allows). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int out_fd = 2;
static struct sigaction old_segv, old_bus, old_abrt;

static void put(const char *s, int n) {
  if (n > 0 && write(out_fd, s, (size_t)n) < 0) { /* nothing to do in a signal handler */ }
}

static void handler(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  void *frames[96];
  char line[320];
  int n = backtrace(frames, 96);
  put(line, snprintf(line, sizeof line, "\n=== native signal %d at address %p, pid %d ===\n", sig,
                     si ? si->si_addr : NULL, (int)getpid()));
  backtrace_symbols_fd(frames, n, out_fd);
  for (int i = 0; i < n; i++) { /* library + offset, for addr2line */
    Dl_info d;
    if (dladdr(frames[i], &d) && d.dli_fname)
      put(line, snprintf(line, sizeof line, "  #%d %s +0x%lx\n", i, d.dli_fname,
                         (unsigned long)((char *)frames[i] - (char *)d.dli_fbase)));
  }
  put("=== end native ===\n", 19);
  struct sigaction *old = sig == SIGSEGV ? &old_segv : sig == SIGBUS ? &old_bus : &old_abrt;
  sigaction(sig, old, NULL);
  raise(sig);
}

static void install_one(int sig, struct sigaction *old) {
  struct sigaction cur, sa;
  sigaction(sig, NULL, &cur);
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == handler) return; /* ours: keep its previous */
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigaction(sig, &sa, old);
}

void segv_install(void) {
  install_one(SIGSEGV, &old_segv);
  install_one(SIGBUS, &old_bus);
  install_one(SIGABRT, &old_abrt);
}

__attribute__((constructor)) static void init(void) {
  void *b[4];
  backtrace(b, 4); /* loads libgcc's unwinder now, not inside the handler */
  const char *path = getenv("CGRAW_DIAG_NATIVE_OUT");
  if (path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) out_fd = fd;
  }
  segv_install();
}
