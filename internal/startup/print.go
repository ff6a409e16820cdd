package startup

import (
	"fmt"
	"io"
	"net/url"
	"reflect"
	"time"

	"go.yaml.in/yaml/v3"

	"worker/internal/obs"
)

// PrintConfig writes the effective configuration as YAML, with durations in
// their text form and secrets masked.
func PrintConfig(w io.Writer, cfg *Config) error {
	enc := yaml.NewEncoder(w)
	enc.SetIndent(2)
	defer enc.Close()
	return enc.Encode(printable(reflect.ValueOf(cfg).Elem(), ""))
}

var durationType = reflect.TypeFor[time.Duration]()

// printable turns config structs into ordered YAML nodes keyed by their
// koanf tags. A field tagged secret:"dsn" has its password masked; any
// other secret-tagged field, or a key named "secret", is hidden whole.
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
			name := f.Tag.Get("koanf")
			sec := f.Tag.Get("secret")
			switch {
			case name == "secret":
				sec = "all"
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
	case v.Kind() == reflect.String && secret == "dsn":
		return obs.MaskDSN(v.String())
	case v.Kind() == reflect.String && secret == "url":
		return maskURL(v.String())
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

// maskURL hides a URL's password and query, which may carry credentials.
func maskURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return obs.MaskDSN(raw)
	}
	if u.User != nil {
		u.User = url.User("xxxxx") // a user name alone may be a token
	}
	if u.RawQuery != "" {
		u.RawQuery = "xxxxx"
	}
	return u.String()
}
