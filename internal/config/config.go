// Package config reads the worker's configuration: built-in defaults, then
// the YAML file, then APP_* variables. It checks every setting's form and
// names the key, line or variable of a mistake, and prints the effective
// configuration with its secrets masked. It builds no part of the worker:
// the checks that need a sink, a source or a database driver are the
// caller's (Options), so this package imports none of them.
package config

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/knadh/koanf/parsers/yaml"
	"github.com/knadh/koanf/providers/confmap"
	kenv "github.com/knadh/koanf/providers/env/v2"
	"github.com/knadh/koanf/providers/file"
	"github.com/knadh/koanf/v2"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// Config is the effective configuration: built-in defaults, then the YAML
// file, then APP_* environment variables.
type Config struct {
	Database struct {
		URL            string        `koanf:"url" secret:"dsn"`
		MigrateOnStart bool          `koanf:"migrate_on_start"`
		ConnectTimeout time.Duration `koanf:"connect_timeout"`
		MaxConns       int           `koanf:"max_conns"`
		Trace          bool          `koanf:"trace"`
	} `koanf:"database"`
	MultiInstance struct {
		Enabled bool `koanf:"enabled"`
	} `koanf:"multi_instance"`
	Instance struct {
		ID string `koanf:"id"`
	} `koanf:"instance"`
	Lock struct {
		Provider string          `koanf:"provider"`
		WaitTime time.Duration   `koanf:"wait_time"`
		LeaseTTL time.Duration   `koanf:"lease_ttl"`
		Redis    RedisLockConfig `koanf:"redis"`
	} `koanf:"lock"`
	HTTP struct {
		Addr  string `koanf:"addr"`
		Pprof bool   `koanf:"pprof"`
	} `koanf:"http"`
	Shutdown struct {
		Timeout time.Duration `koanf:"timeout"`
	} `koanf:"shutdown"`
	Log struct {
		Level  string `koanf:"level"`
		Format string `koanf:"format"`
	} `koanf:"log"`
	AsyncExecutor struct {
		MaxSize int `koanf:"max_size"`
	} `koanf:"async_executor"`
	Outbox outboxconfig.Config     `koanf:"outbox"`
	Inbox  inboxconfig.Config      `koanf:"inbox"`
	Tasks  tasksconfig.Config      `koanf:"tasks"`
	UI     UIConfig                `koanf:"ui"`
	Jobs   []jobsconfig.Definition `koanf:"jobs"`

	// instanceIDDerived is set when instance.id was empty and Load
	// derived one, so `config print` can say how rather than show a value
	// that changes on every call.
	instanceIDDerived bool
	// misspeltEnv names APP_* variables that are no setting and more than
	// maxTypoEdits from every one, yet like one (didYouMean): the logger
	// warns about each, since the setting meant, if any, was not applied.
	misspeltEnv []string
}

// MisspeltEnv are the APP_* variables that are no setting yet look like
// one: the caller warns about each once it has a logger.
func (c *Config) MisspeltEnv() []string { return c.misspeltEnv }

// CheckUI refuses to serve River UI without credentials. Only `run` serves
// it, so operator commands read a file with ui.enabled without needing
// the password.
func (c *Config) CheckUI() error {
	if c.UI.Enabled && (c.UI.Username == "" || c.UI.Password == "") {
		return Errorf("ui.enabled=true needs ui.username (APP_UI_USERNAME) and APP_UI_PASSWORD: River UI is only served behind authentication")
	}
	return nil
}

// DefaultDatabaseURL is database.url when neither the file nor
// APP_DATABASE_URL sets it: a database of the worker's own, named worker as
// scripts/worker creates it, never the server's maintenance database
// postgres, which would receive the worker's and River's tables.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/worker?sslmode=disable"

// Lock providers.
const (
	ProviderInProcess = "inprocess"
	ProviderPostgres  = "postgres"
	ProviderRedis     = "redis"
)

// setting is one scalar configuration key. The table below is the single
// list of keys: defaults, environment names and the docs test all read it.
type setting struct {
	Key     string // koanf path, as in configs/worker.yaml
	Default any
}

// Env is the environment variable that overrides the key.
func (s setting) Env() string { return Env(s.Key) }

// Env is the environment variable that overrides key.
func Env(key string) string { return "APP_" + strings.ToUpper(strings.ReplaceAll(key, ".", "_")) }

// Envs are the variables of every setting, APP_CONFIG_FILE among them.
func Envs() []string {
	envs := []string{configFileEnv}
	for _, s := range settings() {
		envs = append(envs, s.Env())
	}
	return envs
}

func settings() []setting {
	all := []setting{
		{"database.url", DefaultDatabaseURL},
		{"database.migrate_on_start", true},
		{"database.connect_timeout", 30 * time.Second},
		{"database.max_conns", 10},
		{"database.trace", false},
		{"multi_instance.enabled", false},
		{"instance.id", ""},
		{"lock.provider", ""},
		{"lock.wait_time", 100 * time.Millisecond},
		{"lock.lease_ttl", 30 * time.Second},
		{"lock.redis.url", "redis://127.0.0.1:6379/0"},
		{"lock.redis.tls_ca_file", ""},
		{"lock.redis.tls_cert_file", ""},
		{"lock.redis.tls_key_file", ""},
		{"lock.redis.key_prefix", defaultRedisKeyPrefix},
		{"http.addr", ":9090"},
		{"http.pprof", false},
		{"shutdown.timeout", 20 * time.Second},
		{"log.level", "info"},
		{"log.format", "json"},
		{"async_executor.max_size", 10},
		{"ui.enabled", false},
		{"ui.addr", ""},
		{"ui.username", "admin"},
		{"ui.password", ""},
	}
	// The outbox and tasks sections are read off their own defaults, so a
	// field added there is a key here too (and the docs test asks for its
	// rows).
	all = append(all, flatten("outbox", reflect.ValueOf(outboxconfig.DefaultConfig()))...)
	all = append(all, flatten("inbox", reflect.ValueOf(inboxconfig.DefaultConfig()))...)
	return append(all, flatten("tasks", reflect.ValueOf(tasksconfig.DefaultConfig()))...)
}

func flatten(prefix string, v reflect.Value) []setting {
	var out []setting
	for i := range v.NumField() {
		key := prefix + "." + v.Type().Field(i).Tag.Get("koanf")
		switch f := v.Field(i); f.Kind() {
		case reflect.Struct:
			out = append(out, flatten(key, f)...)
		case reflect.Map, reflect.Slice: // YAML-only (tasks.queues, tasks.kinds)
		default:
			out = append(out, setting{key, f.Interface()})
		}
	}
	return out
}

// DefaultConfigFile is read when it exists and no other file is named.
const DefaultConfigFile = "configs/worker.yaml"

// File is the file Load reads: path, or DefaultConfigFile if
// path is "" and that file exists, or "" for none.
func File(path string) string {
	if path == "" {
		if _, err := os.Stat(DefaultConfigFile); err == nil {
			return DefaultConfigFile
		}
	}
	return path
}

// Load builds the effective configuration and checks every setting's form
// and the jobs. path is the file named by --config or APP_CONFIG_FILE (""
// means DefaultConfigFile if it exists); environ is os.Environ() in
// production.
func Load(path string, environ []string) (*Config, error) {
	return Read(path, environ, Options{})
}

// Level is how much of the configuration a command checks.
type Level int

const (
	// CheckAll is what run needs: every setting, and every part run
	// builds (the outbox sink, the inbox sources, the Redis lock client,
	// the jobs) built once without connecting (Options.Parts), so that a
	// mistake stops the start instead of the first publish.
	CheckAll Level = iota
	// CheckDatabase is what an operator command that only reads or changes
	// the database needs: every setting's form, but none of the parts it
	// does not build, so that it runs without a sink's or a source's
	// credentials (docs/operations.md, "Commands").
	CheckDatabase
)

// Options are the checks Read makes beyond the settings' forms: those that
// need what this package does not import.
type Options struct {
	Level Level
	// DatabaseURL parses database.url as the driver does; its error says
	// why the URL is refused. nil takes any URL.
	DatabaseURL func(url string) error
	// TakenJobNames are the jobs the program runs beside the configured
	// ones (built-in and Go jobs); the name is the lock key, so a
	// configured job may not take one. Checked at CheckAll.
	TakenJobNames []string
	// Parts checks, at CheckAll, the parts the program builds from the
	// configuration, without connecting. source names a key as the
	// operator set it (its variable when the environment set it).
	Parts func(c *Config, source func(key string) string) error
}

// Read is Load with the checks a command needs.
func Read(path string, environ []string, opts Options) (*Config, error) {
	all := settings()
	defaults := make(map[string]any, len(all))
	envToKey := make(map[string]string, len(all))
	for _, s := range all {
		defaults[s.Key] = s.Default
		envToKey[s.Env()] = s.Key
	}
	k := koanf.New(".")
	if err := k.Load(confmap.Provider(defaults, "."), nil); err != nil {
		return nil, err
	}

	path = File(path)
	if path != "" {
		fk := koanf.New(".")
		if err := fk.Load(file.Provider(path), yaml.Parser()); err != nil {
			return nil, fileError(path, err)
		}
		if err := checkFileKeys(fk, defaults, path, fileLines(path)); err != nil {
			return nil, err
		}
		if err := k.Merge(fk); err != nil {
			return nil, err
		}
	}

	fromEnv := map[string]string{} // key -> env var, to name the source in errors
	var misspelt, typos []string
	envNames := append(slices.Sorted(maps.Keys(envToKey)), configFileEnv)
	err := k.Load(kenv.Provider(".", kenv.Opt{
		Prefix:      "APP_",
		EnvironFunc: func() []string { return environ },
		TransformFunc: func(name, v string) (string, any) {
			key, ok := envToKey[name]
			if !ok {
				if typo := misspeltSetting(name, envNames); typo != "" {
					typos = append(typos, typo)
				} else if hint := didYouMean(name, envNames); hint != "" && !isOtherEnv(name) {
					misspelt = append(misspelt, name+" is not a setting and is ignored"+hint)
				}
				return "", nil
			}
			fromEnv[key] = name
			return key, v
		},
	}), nil)
	if err != nil {
		return nil, err
	}
	if len(typos) > 0 {
		slices.Sort(typos)
		return nil, Errorf("%s", strings.Join(typos, "\n"))
	}

	source := func(key string) string {
		if name, ok := fromEnv[key]; ok {
			return name
		}
		return key
	}
	for _, s := range all {
		if err := checkType(s, k.Get(s.Key), source(s.Key)); err != nil {
			return nil, err
		}
	}

	var cfg Config
	dec := &mapstructure.DecoderConfig{
		DecodeHook:       mapstructure.ComposeDecodeHookFunc(mapstructure.StringToTimeDurationHookFunc(), joinRouteKeys),
		WeaklyTypedInput: true,
		ErrorUnused:      true,
		Result:           &cfg,
		TagName:          "koanf",
	}
	if err := k.UnmarshalWithConf("", &cfg, koanf.UnmarshalConf{DecoderConfig: dec}); err != nil {
		return nil, Errorf("%w", err)
	}
	if cfg.Inbox.Sources, err = loadInboxSources(k, environ); err != nil {
		return nil, err
	}
	if cfg.Instance.ID == "" {
		cfg.Instance.ID = defaultInstanceID()
		cfg.instanceIDDerived = true
	}
	if cfg.Outbox.MaxInFlight == 0 {
		cfg.Outbox.MaxInFlight = outboxconfig.DefaultMaxInFlight(cfg.Outbox.Sink)
	}
	if err := cfg.validate(source, opts); err != nil {
		return nil, nameEnvSources(err, fromEnv)
	}
	cfg.misspeltEnv = misspelt
	return &cfg, nil
}

// configFileEnv names the configuration file (--config); it is read
// before the settings, so it is no key of the table.
const configFileEnv = "APP_CONFIG_FILE"

// maxTypoEdits is how near (insertions, deletions, substitutions, swaps of
// neighbours) an unknown APP_* variable must be to a setting's variable to
// be taken for its misspelling. The settings' own variables are further
// apart than that (TestSettingsAreFarApart), so a real variable is never
// taken for another's typo.
const maxTypoEdits = 2

// misspeltSetting returns why name stops the start when it is an unknown
// APP_* variable within maxTypoEdits of a setting's variable, "" when it is
// not. Such a variable is most likely that setting misspelt, and running
// without it would leave the setting meant at its value from the file or
// its default: APP_OUTBOX_SINKK=webhook ran the log sink and marked every
// event published.
func misspeltSetting(name string, settings []string) string {
	if isOtherEnv(name) {
		return ""
	}
	best, bestDist := "", maxTypoEdits+1
	for _, s := range settings {
		if d := editDistance(name, s); d < bestDist {
			best, bestDist = s, d
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf("%s is not a setting (did you mean %s?); a variable within %d edits of a setting's name stops the start, since the setting meant would not apply: correct the name or unset it",
		name, best, maxTypoEdits)
}

// isOtherEnv is true for APP_* variables the settings table does not name
// but the worker reads: the file's name, and an inbox source's own keys
// (APP_INBOX_SOURCES_<NAME>_<KEY>, checked by loadInboxSources).
func isOtherEnv(name string) bool {
	return name == configFileEnv || strings.HasPrefix(name, inboxSourcesEnvPrefix)
}

// checkFileKeys rejects keys the worker does not know, so a typo in the YAML
// file is an error instead of a silently ignored setting. The message names
// the line and the nearest known key, and lists every such key, so that a
// file with several mistakes is fixed in one round.
func checkFileKeys(fk *koanf.Koanf, defaults map[string]any, path string, lines lineFinder) error {
	var errs []error
	known := slices.Sorted(maps.Keys(defaults))
	for _, key := range fk.Keys() {
		if key == "jobs" || strings.HasPrefix(key, "jobs.") || isTaskListKey(key) || isRoutesKey(key) || key == InboxSourcesKey {
			continue
		}
		if _, ok := defaults[key]; !ok {
			errs = append(errs, fmt.Errorf("%s: unknown key %q%s; known keys are listed in %s and docs/configuration.md",
				lines.at(strings.Split(key, ".")...), key, didYouMean(key, known), DefaultConfigFile))
		}
	}
	var taskErr *Error
	if errors.As(checkTaskKeys(fk, path), &taskErr) {
		errs = append(errs, errors.New(taskErr.Msg)) // without a second "invalid configuration:"
	}
	errs = append(errs, checkListEntries("jobs", fk.Get("jobs"), reflect.TypeFor[jobsconfig.Definition](), lines)...)
	errs = append(errs, checkListEntries("tasks.kinds", fk.Get("tasks.kinds"), reflect.TypeFor[tasksconfig.Kind](), lines)...)
	errs = append(errs, checkListEntries(InboxSourcesKey, fk.Get(InboxSourcesKey), reflect.TypeFor[inboxconfig.SourceConfig](), lines)...)
	if len(errs) > 0 {
		return Errorf("%w", errors.Join(errs...))
	}
	return nil
}

func tagNames(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		names = append(names, f.Tag.Get("koanf"))
	}
	return names
}

// checkType parses v as the type of the key's default, so a bad value is
// reported with its source (environment variable or YAML key).
func checkType(s setting, v any, source string) error {
	if _, ok := s.Default.(time.Duration); ok {
		if err := checkUnitless(v); err != nil {
			return Errorf("%s=%v %v", source, v, err)
		}
	}
	str, ok := v.(string)
	if !ok {
		return nil // typed already: a default or a YAML scalar of the right kind
	}
	switch s.Default.(type) {
	case time.Duration:
		if _, err := time.ParseDuration(str); err != nil {
			return Errorf("%s=%q %s", source, str, wantDuration)
		}
	case int:
		if _, err := strconv.Atoi(str); err != nil {
			return Errorf("%s=%q %s", source, str, wantWholeNumber)
		}
	case bool:
		if _, err := strconv.ParseBool(str); err != nil {
			return Errorf("%s=%q %s", source, str, wantBoolean)
		}
	}
	return nil
}

// checkUnitless rejects a YAML number where a duration belongs: the decoder
// would read `30` as 30ns. 0 stays allowed (it means "default" for jobs).
func checkUnitless(v any) error {
	switch v.(type) {
	case int, int64, uint64, float64:
		if !reflect.ValueOf(v).IsZero() {
			return errors.New(wantDuration)
		}
	}
	return nil
}

func (c *Config) validate(source func(string) string, opts Options) error {
	for _, p := range []struct {
		key string
		v   time.Duration
	}{
		{"database.connect_timeout", c.Database.ConnectTimeout},
		{"lock.lease_ttl", c.Lock.LeaseTTL},
		{"lock.wait_time", c.Lock.WaitTime},
		{"shutdown.timeout", c.Shutdown.Timeout},
	} {
		if b := ownDurationBounds[p.key]; !b.allows(p.v) {
			return Errorf("%s=%s %s", source(p.key), p.v, b.refusal(p.v))
		}
	}
	if c.Lock.LeaseTTL < c.Lock.WaitTime {
		return Errorf("%s=%s is shorter than %s=%s; the lease must outlive the wait for it",
			source("lock.lease_ttl"), c.Lock.LeaseTTL, source("lock.wait_time"), c.Lock.WaitTime)
	}
	switch c.Lock.Provider {
	case "", ProviderInProcess, ProviderPostgres, ProviderRedis:
	default:
		return Errorf("%s=%q is not a lock provider; want %s, %s or %s", source("lock.provider"), c.Lock.Provider,
			ProviderPostgres, ProviderRedis, ProviderInProcess)
	}
	if c.Lock.Provider == "" && !c.MultiInstance.Enabled {
		c.Lock.Provider = ProviderInProcess
	}
	if !slices.Contains([]string{"debug", "info", "warn", "error"}, c.Log.Level) {
		return Errorf("%s=%q; want debug, info, warn or error", source("log.level"), c.Log.Level)
	}
	if c.Log.Format != "json" && c.Log.Format != "text" {
		return Errorf("%s=%q; want json or text", source("log.format"), c.Log.Format)
	}
	if c.AsyncExecutor.MaxSize < 1 {
		return Errorf("%s=%d must be at least 1", source("async_executor.max_size"), c.AsyncExecutor.MaxSize)
	}
	if c.Database.MaxConns < 2 {
		return Errorf("%s=%d must be at least 2", source("database.max_conns"), c.Database.MaxConns)
	}
	if opts.DatabaseURL != nil {
		if err := opts.DatabaseURL(c.Database.URL); err != nil {
			return Errorf("%s is not a PostgreSQL URL: %s", source("database.url"), obs.MaskDSN(err.Error()))
		}
	}
	if err := validateListenAddr(source("http.addr"), c.HTTP.Addr); err != nil {
		return err
	}
	if c.UI.Addr != "" {
		if err := validateListenAddr(source("ui.addr"), c.UI.Addr); err != nil {
			return err
		}
		if c.UI.Addr == c.HTTP.Addr {
			return Errorf("%s=%q is http.addr too; want another address, or empty to serve River UI on http.addr", source("ui.addr"), c.UI.Addr)
		}
	}
	if err := c.Outbox.Validate(); err != nil {
		return Errorf("%w", err)
	}
	// Relay loops keep their connection while there is backlog; jobs,
	// leases and the metrics refresh must still get one.
	if c.Outbox.Enabled && c.Database.MaxConns <= c.Outbox.Relays {
		return Errorf("%s=%d must exceed %s=%d: each relay loop holds a connection while there is backlog, and jobs and leases need one too",
			source("database.max_conns"), c.Database.MaxConns, source("outbox.relays"), c.Outbox.Relays)
	}
	if err := c.Tasks.Validate(); err != nil {
		return Errorf("%v", err)
	}
	if err := c.Inbox.Validate(); err != nil {
		return Errorf("%w", err)
	}
	if opts.Level == CheckDatabase {
		return nil
	}
	if opts.Parts != nil {
		if err := opts.Parts(c, source); err != nil {
			return err
		}
	}
	return c.validateJobs(source, opts.TakenJobNames)
}

// validateJobs checks every job and reports each one that is wrong, in one
// error. reserved are the names of the program's own jobs.
func (c *Config) validateJobs(source func(string) string, reserved []string) error {
	errs := []error{jobsconfig.ValidateDefinitions(c.Jobs)}
	for i, d := range c.Jobs {
		if slices.Contains(reserved, d.Name) {
			errs = append(errs, fmt.Errorf("jobs[%d] %q: name is taken by a job built into the worker (%s); choose another",
				i, d.Name, strings.Join(reserved, ", ")))
		}
		if d.LeaseTTL > 0 && d.LeaseTTL < c.Lock.WaitTime {
			errs = append(errs, fmt.Errorf("jobs[%d] %q: lease_ttl %s is shorter than %s=%s; the lease must outlive the wait for it",
				i, d.Name, d.LeaseTTL, source("lock.wait_time"), c.Lock.WaitTime))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return Errorf("%w", err)
	}
	return nil
}

// defaultInstanceID is used when instance.id is empty: unique per process,
// and still recognisable by its host.
func defaultInstanceID() string {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return instanceHost() + "-" + hex.EncodeToString(b)
}

// earlySetting reads one key as far as it can be when the full
// configuration is invalid: from its environment variable (which wins over
// the file, even when wrong), then the file. ok is false when neither sets
// it.
func earlySetting(path string, environ []string, key string) (v string, ok bool) {
	env := setting{Key: key}.Env() + "="
	for _, kv := range slices.Backward(environ) {
		if v, ok := strings.CutPrefix(kv, env); ok {
			return v, true
		}
	}
	if path == "" {
		path = DefaultConfigFile
	}
	fk := koanf.New(".")
	if fk.Load(file.Provider(path), yaml.Parser()) == nil && fk.Exists(key) {
		return fk.String(key), true
	}
	return "", false
}

// EarlyLogFormat is log.format read by earlySetting; JSON unless that is a
// valid format.
func EarlyLogFormat(path string, environ []string) string {
	if f, _ := earlySetting(path, environ, "log.format"); f == "text" {
		return f
	}
	return "json"
}

// EarlyInstanceID is instance.id read by earlySetting, or one derived as
// Load derives it: every log line names its replica, also the one
// saying why the configuration was refused.
func EarlyInstanceID(path string, environ []string) string {
	if id, _ := earlySetting(path, environ, "instance.id"); id != "" {
		return id
	}
	return defaultInstanceID()
}

func instanceHost() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "worker"
	}
	return host
}

// isRoutesKey is true for the river sink's routes, a YAML-only map whose
// keys are event types.
func isRoutesKey(key string) bool {
	return key == outboxconfig.RoutesKey || strings.HasPrefix(key, outboxconfig.RoutesKey+".")
}

// joinRouteKeys undoes koanf's split of keys at dots for the river sink's
// routes, whose keys are event types such as order.shipped: YAML
// {order.shipped: k} arrives as {order: {shipped: k}}. It is the only
// map[string]string koanf splits: task kind headers sit in a list.
func joinRouteKeys(_, to reflect.Type, data any) (any, error) {
	m, ok := data.(map[string]any)
	if !ok || to != reflect.TypeFor[map[string]string]() {
		return data, nil
	}
	flat := map[string]any{}
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			if sub, ok := v.(map[string]any); ok {
				walk(prefix+k+".", sub)
				continue
			}
			flat[prefix+k] = v
		}
	}
	walk("", m)
	return flat, nil
}

// validateListenAddr checks an address to listen on; name is the key as
// the operator set it.
func validateListenAddr(name, addr string) error {
	if _, port, err := net.SplitHostPort(addr); err != nil {
		return Errorf("%s=%q; want host:port or :port", name, addr)
	} else if _, err := net.LookupPort("tcp", port); err != nil {
		return Errorf("%s=%q: %q is not a port; want host:port or :port", name, addr, port)
	}
	return nil
}
