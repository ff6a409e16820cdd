package config

import (
	"reflect"
	"slices"
	"strings"

	"github.com/go-viper/mapstructure/v2"
	"github.com/knadh/koanf/v2"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// defaultRedisKeyPrefix is lock.DefaultRedisKeyPrefix, written out so that
// reading the configuration does not pull in the lock providers' clients
// (TestRedisKeyPrefixDefault holds the two alike).
const defaultRedisKeyPrefix = "worker:lock:"

// RedisLockConfig is lock.redis: the Redis of lock.provider=redis. The TLS
// files follow the sinks' keys.
type RedisLockConfig struct {
	// URL: redis://[user:password@]host:port/db, or rediss:// for TLS.
	URL         string `koanf:"url" secret:"url"`
	TLSCAFile   string `koanf:"tls_ca_file"`
	TLSCertFile string `koanf:"tls_cert_file"`
	TLSKeyFile  string `koanf:"tls_key_file"`
	// KeyPrefix starts every key the provider writes, so that deployments
	// can share one Redis database.
	KeyPrefix string `koanf:"key_prefix"`
}

// UIConfig is the `ui:` section: River UI, on the ops server or on its own
// address.
type UIConfig struct {
	Enabled bool `koanf:"enabled"`
	// Addr, when set, serves the UI there and not on http.addr, so that
	// /metrics can be open to Prometheus while the UI is reachable only
	// by operators.
	Addr     string `koanf:"addr"`
	Username string `koanf:"username"`
	Password string `koanf:"password" secret:"password"`
}

// InboxSourcesKey is the YAML-only list of inbox sources.
const InboxSourcesKey = "inbox.sources"

// inboxSourcesEnvPrefix starts the variables of one source's keys,
// APP_INBOX_SOURCES_<NAME>_<KEY>.
const inboxSourcesEnvPrefix = "APP_INBOX_SOURCES_"

// loadInboxSources reads inbox.sources: each entry starts from
// inboxconfig.DefaultSource, then its YAML keys, then its environment variables,
// APP_INBOX_SOURCES_<NAME>_<KEY> (name upper-cased, '-' as '_'; key as in
// the entry, '.' as '_'), so that a secret never has to be in the file.
func loadInboxSources(k *koanf.Koanf, environ []string) ([]inboxconfig.SourceConfig, error) {
	raw := k.Get(InboxSourcesKey)
	if raw == nil {
		return nil, nil
	}
	list, ok := raw.([]any)
	if !ok {
		return nil, Errorf("%s must be a list of source entries", InboxSourcesKey)
	}
	keys := flatten("", reflect.ValueOf(inboxconfig.DefaultSource()))
	var out []inboxconfig.SourceConfig
	for i, entry := range list {
		s := inboxconfig.DefaultSource()
		if err := decodeInto(entry, &s); err != nil {
			return nil, Errorf("%s[%d]: %w", InboxSourcesKey, i, err)
		}
		prefix := inboxSourcesEnvPrefix + strings.ToUpper(strings.ReplaceAll(s.Name, "-", "_")) + "_"
		over := map[string]any{}
		for _, kv := range environ {
			name, v, _ := strings.Cut(kv, "=")
			rest, ok := strings.CutPrefix(name, prefix)
			if !ok || s.Name == "" {
				continue
			}
			key := ""
			for _, st := range keys {
				k := strings.TrimPrefix(st.Key, ".")
				if strings.ToUpper(strings.ReplaceAll(k, ".", "_")) == rest {
					key = k
				}
			}
			if key == "" {
				return nil, Errorf("%s is not a key of inbox source %q", name, s.Name)
			}
			if f, ok := fieldByKey(reflect.TypeFor[inboxconfig.SourceConfig](), key); ok {
				if problem := valueProblem(f.Type, v); problem != "" {
					return nil, Errorf("%s=%s %s", name, shownValue(f, v), problem)
				}
			}
			setPath(over, strings.Split(key, "."), v)
		}
		if len(over) > 0 {
			if err := decodeInto(over, &s); err != nil {
				return nil, Errorf("%s[%d] (%s*): %w", InboxSourcesKey, i, prefix, err)
			}
		}
		out = append(out, s)
	}
	return out, nil
}

// decodeInto decodes a YAML or environment map onto v, keeping the
// fields it does not name, and refusing keys v does not have.
func decodeInto(in any, v any) error {
	dec, err := mapstructure.NewDecoder(&mapstructure.DecoderConfig{
		DecodeHook:       mapstructure.StringToTimeDurationHookFunc(),
		WeaklyTypedInput: true,
		ErrorUnused:      true,
		Result:           v,
		TagName:          "koanf",
	})
	if err != nil {
		return err
	}
	return dec.Decode(in)
}

func setPath(m map[string]any, path []string, v string) {
	for _, p := range path[:len(path)-1] {
		next, ok := m[p].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[p] = next
		}
		m = next
	}
	m[path[len(path)-1]] = v
}

// isTaskListKey is true for the YAML-only parts of `tasks:` (queues and
// kinds), which checkTaskKeys and checkListEntries check instead of the
// scalar key list.
func isTaskListKey(key string) bool {
	return key == "tasks.kinds" || key == "tasks.queues" || strings.HasPrefix(key, "tasks.queues.")
}

// checkTaskKeys rejects unknown keys under tasks.queues.<name>
// (checkListEntries checks the tasks.kinds entries).
func checkTaskKeys(fk *koanf.Koanf, path string) error {
	queueKeys := tagNames(reflect.TypeFor[tasksconfig.Queue]())
	for _, key := range fk.Keys() {
		rest, ok := strings.CutPrefix(key, "tasks.queues.")
		if !ok {
			continue
		}
		name, field, _ := strings.Cut(rest, ".")
		if !slices.Contains(queueKeys, field) {
			return Errorf("%s: tasks.queues.%s: unknown key %q; allowed: %s", path, name, field, strings.Join(queueKeys, ", "))
		}
	}
	return nil
}
