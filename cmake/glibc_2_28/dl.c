/* Link-time stand-in for glibc 2.28's libdl.so.2 (never loaded, never installed): libopgraft's
 * references to these functions get the versions that libdl has there and every later glibc keeps
 * (since 2.34 in libc). The bodies never run. */
void *dlopen(const char *file, int mode) { return (void *)0; }
void *dlsym(void *handle, const char *name) { return (void *)0; }
char *dlerror(void) { return (char *)0; }
int dlclose(void *handle) { return 0; }
int dlinfo(void *handle, int request, void *arg) { return 0; }
