/*
 * A PKCS#11 module that is a real module (SoftHSMv2) with the session limit of a smart card:
 * like pkcs11-spy, it passes every call through to SoftHSM, except that it allows an
 * application LIMIT_SESSIONS sessions at once (C_OpenSession answers CKR_SESSION_COUNT beyond
 * that), and C_GetTokenInfo reports that limit as ulMaxSessionCount, or CK_EFFECTIVELY_INFINITE
 * when LIMIT_REPORT is 0 (a module that does not say). Every C_OpenSession is appended to the
 * file LIMIT_LOG as "open N" (N sessions open after it) or "refused".
 *
 * With -DHIDE_LISTINGS=N, the first N listings of slots with a token (C_GetSlotList with
 * tokenPresent) find none, as SoftHSM lists none when, at its C_Initialize, another process was
 * rewriting the token's file.
 *
 * The settings are compile-time (-DLIMIT_SESSIONS=2 -DLIMIT_REPORT=0 -DLIMIT_LOG='"/path"'), so
 * two builds at two paths are two independent modules in one process. Built by
 * tests/support/session_limit.rs for the PKCS#11 key tests.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <p11-kit/pkcs11.h>

static CK_FUNCTION_LIST_PTR real;
static CK_FUNCTION_LIST shim;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long open_now;
static const unsigned long limit = LIMIT_SESSIONS;
static const int report = LIMIT_REPORT;

static void note(const char *what)
{
    FILE *f = fopen(LIMIT_LOG, "a");
    if (!f)
        return;
    fprintf(f, "%s\n", what);
    fclose(f);
}

static CK_RV limited_open(CK_SLOT_ID slot, CK_FLAGS flags, CK_VOID_PTR app, CK_NOTIFY notify,
                          CK_SESSION_HANDLE_PTR session)
{
    CK_RV rv;
    char line[64];
    pthread_mutex_lock(&lock);
    if (open_now >= limit) {
        note("refused");
        pthread_mutex_unlock(&lock);
        return CKR_SESSION_COUNT;
    }
    rv = real->C_OpenSession(slot, flags, app, notify, session);
    if (rv == CKR_OK) {
        open_now++;
        snprintf(line, sizeof line, "open %lu", open_now);
        note(line);
    }
    pthread_mutex_unlock(&lock);
    return rv;
}

static CK_RV limited_close(CK_SESSION_HANDLE session)
{
    CK_RV rv = real->C_CloseSession(session);
    pthread_mutex_lock(&lock);
    if (rv == CKR_OK && open_now > 0)
        open_now--;
    pthread_mutex_unlock(&lock);
    return rv;
}

static CK_RV limited_close_all(CK_SLOT_ID slot)
{
    CK_RV rv = real->C_CloseAllSessions(slot);
    pthread_mutex_lock(&lock);
    if (rv == CKR_OK)
        open_now = 0;
    pthread_mutex_unlock(&lock);
    return rv;
}

static CK_RV limited_token_info(CK_SLOT_ID slot, CK_TOKEN_INFO_PTR info)
{
    CK_RV rv = real->C_GetTokenInfo(slot, info);
    if (rv == CKR_OK) {
        info->ulMaxSessionCount = report ? limit : CK_EFFECTIVELY_INFINITE;
        info->ulSessionCount = open_now;
    }
    return rv;
}

#ifdef HIDE_LISTINGS
static int listings;
static int hiding;

static CK_RV hiding_slot_list(CK_BBOOL present, CK_SLOT_ID_PTR slots, CK_ULONG_PTR count)
{
    if (present && slots == NULL_PTR) {
        listings++;
        hiding = listings <= HIDE_LISTINGS;
    }
    if (present && hiding) {
        *count = 0;
        return CKR_OK;
    }
    return real->C_GetSlotList(present, slots, count);
}
#endif

CK_RV C_GetFunctionList(CK_FUNCTION_LIST_PTR_PTR list)
{
    void *module;
    CK_RV (*get)(CK_FUNCTION_LIST_PTR_PTR);
    CK_RV rv;
    if (!real) {
        module = dlopen("/usr/lib/softhsm/libsofthsm2.so", RTLD_NOW | RTLD_LOCAL);
        if (!module)
            return CKR_GENERAL_ERROR;
        get = (CK_RV(*)(CK_FUNCTION_LIST_PTR_PTR))dlsym(module, "C_GetFunctionList");
        if (!get)
            return CKR_GENERAL_ERROR;
        rv = get(&real);
        if (rv != CKR_OK)
            return rv;
        memcpy(&shim, real, sizeof shim);
        shim.C_OpenSession = limited_open;
        shim.C_CloseSession = limited_close;
        shim.C_CloseAllSessions = limited_close_all;
        shim.C_GetTokenInfo = limited_token_info;
#ifdef HIDE_LISTINGS
        shim.C_GetSlotList = hiding_slot_list;
#endif
    }
    *list = &shim;
    return CKR_OK;
}
