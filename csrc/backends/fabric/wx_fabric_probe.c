/* wx_fabric_probe.c - what the installed libfabric offers for one-sided writes, and which of
 * its providers offer device memory (FI_HMEM).
 *
 * Two fi_getinfo calls with the hints the backend opens with (FI_EP_RDM, FI_RMA | FI_WRITE |
 * FI_REMOTE_WRITE, every mr_mode bit it can honour), the second one with FI_HMEM (and
 * FI_MR_HMEM) as well; a provider that answers only the first does not offer device memory.
 * The result is one JSON object (wx_fabric_probe_json), read by wxfer.tools.gpuprobe, the
 * `gpu` tests and the error a transport opened with hmem=on gives where no provider fits. */
#include "wx_fabric.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Distinct "provider (domain)" entries of fi_getinfo's answer, as a JSON array body. */
static int wx__probe_list(const wx_fi_api_t *api, int hmem, char *out, size_t len, char *names,
                          size_t names_len)
{
    struct fi_info *h = api->fi_dupinfo(NULL), *list = NULL;
    uint32_t ver = api->fi_version();
    size_t off = 0;
    int rc, n = 0;
    out[0] = names[0] = '\0';
    if (!h)
        return -ENOMEM;
    h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | (hmem ? FI_HMEM : 0);
    h->mode = FI_CONTEXT | FI_CONTEXT2;
    h->ep_attr->type = FI_EP_RDM;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                              FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
    if (ver > FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION))
        ver = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
    rc = api->fi_getinfo(ver, NULL, NULL, 0, h, &list);
    api->fi_freeinfo(h);
    if (rc)
        return rc == -FI_ENODATA ? 0 : rc;
    for (struct fi_info *i = list; i; i = i->next) {
        const char *p =
            i->fabric_attr && i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
        const char *d = i->domain_attr && i->domain_attr->name ? i->domain_attr->name : "?";
        char key[200];
        int k;
        snprintf(key, sizeof key, "|%s/%s|", p, d);
        if (strstr(names, key))
            continue;
        if (strlen(names) + strlen(key) + 1 < names_len)
            strcat(names, key);
        k = snprintf(out + off, off < len ? len - off : 0,
                     "%s{\"provider\": \"%s\", \"domain\": \"%s\", \"fabric\": \"%s\", "
                     "\"hmem\": %s, \"mr_mode\": %llu, \"max_msg_size\": %llu}",
                     n ? ", " : "", p, d,
                     i->fabric_attr && i->fabric_attr->name ? i->fabric_attr->name : "?",
                     (i->caps & FI_HMEM) ? "true" : "false",
                     (unsigned long long)(i->domain_attr ? i->domain_attr->mr_mode : 0),
                     (unsigned long long)(i->ep_attr ? i->ep_attr->max_msg_size : 0));
        if (k > 0)
            off += (size_t)k;
        n++;
    }
    api->fi_freeinfo(list);
    return off < len ? n : -ENOSPC;
}

int wx_fabric_probe_json(char *buf, size_t len)
{
    char why[256], all[8192], hm[8192], names_all[4096], names_hm[4096];
    const wx_fi_api_t *api = wx_fi(why, sizeof why);
    uint32_t v;
    int na, nh;
    if (!api) {
        snprintf(buf, len, "{\"loaded\": false, \"why\": \"%s\"}", why);
        return 0;
    }
    v = api->fi_version();
    na = wx__probe_list(api, 0, all, sizeof all, names_all, sizeof names_all);
    nh = wx__probe_list(api, 1, hm, sizeof hm, names_hm, sizeof names_hm);
    if (na < 0 || nh < 0)
        return wx_errf(na < 0 ? na : nh, "fabric probe: fi_getinfo failed: %s",
                       wx_fi_strerror(na < 0 ? na : nh));
    if ((size_t)snprintf(buf, len,
                         "{\"loaded\": true, \"version\": \"%u.%u\", \"headers\": \"%u.%u\", "
                         "\"rma\": [%s], \"rma_hmem\": [%s]}",
                         FI_MAJOR(v), FI_MINOR(v), FI_MAJOR_VERSION, FI_MINOR_VERSION, all,
                         hm) >= len)
        return wx_errf(-ENOSPC, "fabric probe: answer longer than %zu bytes", len);
    return 0;
}

/* "shm, efa" for the error of a transport opened with hmem=on; "" when none. */
void wx__fab_hmem_providers(char *out, size_t len)
{
    char why[64], hm[8192], names[4096];
    const wx_fi_api_t *api = wx_fi(why, sizeof why);
    const char *p;
    size_t off = 0;
    out[0] = '\0';
    if (!api || wx__probe_list(api, 1, hm, sizeof hm, names, sizeof names) <= 0)
        return;
    for (p = names; (p = strchr(p, '|')) && p[1];) {
        const char *e = strchr(p + 1, '|');
        if (!e)
            break;
        int k = snprintf(out + off, off < len ? len - off : 0, "%s%.*s", off ? ", " : "",
                         (int)(e - p - 1), p + 1);
        if (k > 0)
            off += (size_t)k;
        p = e + 1;
    }
}
