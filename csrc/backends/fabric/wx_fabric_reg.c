/* wx_fabric_reg.c - memory registration for the libfabric backend.
 *
 * What the returned fi_info's mr_mode says decides everything here:
 *   FI_MR_VIRT_ADDR  remote addresses are virtual addresses: rbase = addr (shm, efa);
 *                    otherwise offsets into the region: rbase = 0 (tcp;ofi_rxm, mode 0);
 *   FI_MR_PROV_KEY   the provider chooses keys (efa): key_is_backend, key = fi_mr_key();
 *                    otherwise the generic layer's unique key is requested (a duplicate
 *                    would fail with FI_ENOKEY);
 *   FI_MR_LOCAL      write sources must be registered too and their desc passed (efa);
 *   FI_MR_HMEM       device memory must be registered wherever it is used.
 * CUDA memory is registered with FI_HMEM_CUDA only where the provider offers FI_HMEM.
 */
#include "wx_fabric.h"

#include <stdio.h>
#include <string.h>

int wx__fab_reg(wx_transport_t *t, wx_mr_t *mr)
{
    wx_fab_t *f = WX_FAB(t);
    int cuda = mr->mem == WX_MEM_CUDA;
    struct fi_mr_attr attr;
    struct iovec iov;
    struct fid_mr *fmr = NULL;
    int rc;

    if (cuda && !f->hmem)
        return wx_errf(-ENOTSUP,
                       "fabric: cannot register CUDA memory (device %d, %llu bytes): provider %s "
                       "does not offer FI_HMEM (device memory); use a provider with HMEM "
                       "support (e.g. efa built with CUDA) or stage the data in host memory",
                       mr->device, (unsigned long long)mr->len, f->prov);
    mr->rbase = (f->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)mr->addr : 0;
    mr->blob_len = 0;
    mr->priv = NULL;
    mr->ldesc = NULL;
    /* A write source that the provider does not need registered costs nothing. */
    if (!mr->exported && !(f->mr_mode & FI_MR_LOCAL) && !(cuda && (f->mr_mode & FI_MR_HMEM)))
        return 0;

    memset(&attr, 0, sizeof attr);
    iov.iov_base = mr->addr;
    iov.iov_len = mr->len;
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = FI_WRITE | (mr->exported ? FI_REMOTE_WRITE : 0);
    attr.requested_key = t->key_is_backend ? 0 : mr->key;
    attr.iface = cuda ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
    if (cuda)
        attr.device.cuda = mr->device;
    if (f->serialize)
        pthread_mutex_lock(&f->dlock);
    rc = fi_mr_regattr(f->domain, &attr, 0, &fmr);
    if (f->serialize)
        pthread_mutex_unlock(&f->dlock);
    if (rc) {
        if (rc == -FI_ENOKEY)
            return wx__fab_err(rc,
                               "fabric: fi_mr_regattr(provider %s, key 0x%llx already in "
                               "use, %llu bytes at %p)",
                               f->prov, (unsigned long long)mr->key, (unsigned long long)mr->len,
                               mr->addr);
        if (cuda)
            return wx__fab_err(rc,
                               "fabric: fi_mr_regattr(provider %s, CUDA memory of device %d via "
                               "FI_HMEM_CUDA, %llu bytes at %p) (libfabric %u.%u offers FI_HMEM "
                               "here but cannot register CUDA memory: it was built without "
                               "CUDA support (--with-cuda) or cannot load libcudart/libcuda; "
                               "fix: a libfabric built with CUDA, e.g. the EFA installer's)",
                               f->prov, mr->device, (unsigned long long)mr->len, mr->addr,
                               FI_MAJOR(f->api->fi_version()), FI_MINOR(f->api->fi_version()));
        return wx__fab_err(rc, "fabric: fi_mr_regattr(provider %s, host memory, %llu bytes at %p)",
                           f->prov, (unsigned long long)mr->len, mr->addr);
    }
    if (f->mr_mode & FI_MR_ENDPOINT) {
        if ((rc = fi_mr_bind(fmr, &f->ep->fid, 0)) || (rc = fi_mr_enable(fmr))) {
            fi_close(&fmr->fid);
            return wx__fab_err(rc, "fabric: fi_mr_bind/fi_mr_enable(provider %s)", f->prov);
        }
    }
    if (t->key_is_backend) {
        uint64_t key = fi_mr_key(fmr);
        if (key == FI_KEY_NOTAVAIL) {
            fi_close(&fmr->fid);
            return wx_errf(-ENOTSUP,
                           "fabric: provider %s uses raw memory keys, which wxfer "
                           "does not support",
                           f->prov);
        }
        mr->key = key;
    }
    mr->priv = fmr;
    mr->ldesc = fi_mr_desc(fmr);
    atomic_fetch_add(cuda ? &f->n_reg_cuda : &f->n_reg_host, 1);
    return 0;
}

void wx__fab_dereg(wx_transport_t *t, wx_mr_t *mr)
{
    wx_fab_t *f = WX_FAB(t);
    struct fid_mr *fmr = mr->priv;
    int rc;
    if (!fmr)
        return;
    if (f->serialize)
        pthread_mutex_lock(&f->dlock);
    rc = fi_close(&fmr->fid);
    if (f->serialize)
        pthread_mutex_unlock(&f->dlock);
    if (rc)
        wx_debugf("fabric: fi_close(mr key 0x%llx) failed: %s", (unsigned long long)mr->key,
                  wx_fi_strerror(rc));
    mr->priv = NULL;
    mr->ldesc = NULL;
}
