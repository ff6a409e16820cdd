package config

import (
	"cmp"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/obs"
)

// Print writes the configuration the worker will use as YAML: with each
// job's defaults filled in and only the keys of its kind, durations in
// their text form and secrets masked. A broker's comma-separated server
// list (secret:"urls") is masked as the brokers' own errors show it.
func Print(w io.Writer, cfg *Config) error {
	eff := *cfg
	eff.Jobs = make([]jobsconfig.Definition, len(cfg.Jobs))
	for i, d := range cfg.Jobs {
		eff.Jobs[i] = effectiveJob(d, cfg.Lock.LeaseTTL)
	}
	root := printable(reflect.ValueOf(&eff).Elem(), "").(*yaml.Node)
	if cfg.instanceIDDerived {
		// A derived id is new at every start: say how it is made instead of
		// showing one that the worker will not use.
		id := child(child(root, "instance"), "id")
		id.Value, id.Tag, id.Style = instanceHost()+"-<random>", "!!str", 0
		id.LineComment = "derived at each start: hostname, '-', 6 random hex digits (set instance.id to fix it)"
	}
	enc := yaml.NewEncoder(w)
	enc.SetIndent(2)
	defer enc.Close()
	return enc.Encode(root)
}

// effectiveJob is d with the defaults the scheduler applies filled in (see
// jobs.Spec and jobs.FromDefinitions).
func effectiveJob(d jobsconfig.Definition, leaseTTL time.Duration) jobsconfig.Definition {
	if d.Timeout == 0 {
		d.Timeout = jobsconfig.DefaultTimeout
	}
	if d.LeaseTTL == 0 {
		d.LeaseTTL = leaseTTL
	}
	enabled := d.IsEnabled()
	d.Enabled = &enabled
	if d.Kind == jobsconfig.KindHTTP {
		d.Method = strings.ToUpper(cmp.Or(d.Method, http.MethodGet))
	}
	return d
}

// child returns the value of key in a YAML mapping node.
func child(n *yaml.Node, key string) *yaml.Node {
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	panic("config print: no key " + key)
}

var durationType = reflect.TypeFor[time.Duration]()

// printable turns config structs into ordered YAML nodes keyed by their
// koanf tags. A field tagged secret:"dsn" has its password masked; any
// other secret-tagged field, or one whose key names a secret
// (obs.IsSecretKey: password, token, secret, ...), is hidden whole.
func printable(v reflect.Value, secret string) any {
	switch {
	case v.Type() == durationType:
		return v.Interface().(time.Duration).String()
	case v.Kind() == reflect.Pointer:
		if v.IsNil() {
			return nil
		}
		return printable(v.Elem(), secret)
	case v.Kind() == reflect.Struct:
		node := &yaml.Node{Kind: yaml.MappingNode}
		for i := range v.NumField() {
			f := v.Type().Field(i)
			if !f.IsExported() || omitted(f, v.Field(i)) {
				continue
			}
			name := f.Tag.Get("koanf")
			sec := f.Tag.Get("secret")
			switch {
			case sec == "" && obs.IsSecretKey(name):
				sec = "all" // a password, token or secret even if untagged
			case name == "url" && sec == "":
				sec = "url" // job and webhook URLs: user info and query may carry credentials
			case name == "headers":
				sec = "values"
			}
			var val yaml.Node
			if err := val.Encode(printable(v.Field(i), sec)); err != nil {
				panic(err) // only plain values reach here
			}
			node.Content = append(node.Content, &yaml.Node{Kind: yaml.ScalarNode, Value: name}, &val)
		}
		return node
	case v.Kind() == reflect.Slice:
		out := make([]any, v.Len())
		for i := range out {
			out[i] = printable(v.Index(i), "")
		}
		return out
	case v.Kind() == reflect.String && (secret == "dsn" || secret == "url"):
		return obs.MaskDSN(v.String()) // user information and query string
	case v.Kind() == reflect.String && secret == "urls":
		return broker.RedactURLs(v.String()) // a broker's comma-separated server list
	case v.Kind() == reflect.Map && secret == "values":
		// Header values often carry tokens (Authorization, X-Api-Key):
		// show the names only.
		out := make(map[string]string, v.Len())
		for _, k := range v.MapKeys() {
			out[fmt.Sprint(k.Interface())] = "xxxxx"
		}
		return out
	case v.Kind() == reflect.String && secret != "" && v.String() != "":
		return "xxxxx"
	}
	return v.Interface()
}

// omitted reports whether a field tagged yaml:",omitempty" is empty: a job's
// keys of the other kind.
func omitted(f reflect.StructField, v reflect.Value) bool {
	_, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
	return opts == "omitempty" && v.IsZero()
}
